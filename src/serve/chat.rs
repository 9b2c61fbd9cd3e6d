//! The chat template of a model's tokenizer (Jinja, as transformers' `apply_chat_template`
//! renders it): found in the tokenizer's settings (`tokenizer_config.json`'s `chat_template`,
//! a string or a list of named templates whose `default` is taken, or transformers' separate
//! `chat_template.jinja` / `chat_template.json`), rendered with `messages`, `bos_token`,
//! `eos_token` and `add_generation_prompt = true`, with transformers' `trim_blocks` and
//! `lstrip_blocks`.

use std::collections::BTreeMap;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// One message of a chat request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// A compiled chat template and the special tokens it may name.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// Where the template came from (errors).
    source: String,
}

/// A token named in a tokenizer's settings: a string, or an `AddedToken` object's `content`.
fn token_name(v: &serde_json::Value) -> String {
    v.as_str().or_else(|| v["content"].as_str()).unwrap_or_default().to_string()
}

/// The template text of a `chat_template` value: a string, or a list of `{name, template}`.
fn template_text(v: &serde_json::Value, file: &str) -> Result<Option<String>> {
    match v {
        serde_json::Value::Null => Ok(None),
        serde_json::Value::String(s) => Ok(Some(s.clone())),
        serde_json::Value::Array(list) => {
            let named = |n: &str| list.iter().find(|t| t["name"] == n).and_then(|t| t["template"].as_str());
            match named("default").or_else(|| list.first().and_then(|t| t["template"].as_str())) {
                Some(t) => Ok(Some(t.to_string())),
                None => {
                    bail!("{file}: key `chat_template` = a list without a `template`: expected a string or [{{\"name\", \"template\"}}]")
                }
            }
        }
        other => bail!("{file}: key `chat_template` = {other}: expected a string or a list of named templates"),
    }
}

impl ChatTemplate {
    /// The template among a model's tokenizer files (name → text, as `hf::companions` reads
    /// them); `None` when they have none.
    pub fn from_files(files: &BTreeMap<String, String>) -> Result<Option<ChatTemplate>> {
        let settings: serde_json::Value = match files.get("tokenizer_config.json") {
            Some(t) => serde_json::from_str(t).context("tokenizer_config.json: not JSON")?,
            None => serde_json::Value::Null,
        };
        let (text, source) = if let Some(t) = files.get("chat_template.jinja") {
            (Some(t.clone()), "chat_template.jinja")
        } else if let Some(t) = files.get("chat_template.json") {
            let doc: serde_json::Value = serde_json::from_str(t).context("chat_template.json: not JSON")?;
            (template_text(&doc["chat_template"], "chat_template.json")?, "chat_template.json")
        } else {
            (template_text(&settings["chat_template"], "tokenizer_config.json")?, "tokenizer_config.json")
        };
        let Some(text) = text else { return Ok(None) };
        let bos = token_name(&settings["bos_token"]);
        let eos = token_name(&settings["eos_token"]);
        ChatTemplate::new(&text, source, bos, eos).map(Some)
    }

    /// Compiles `text` (from `source`, named in errors).
    pub fn new(text: &str, source: &str, bos_token: String, eos_token: String) -> Result<ChatTemplate> {
        let mut env = minijinja::Environment::new();
        // What transformers' `apply_chat_template` sets on its Jinja environment.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", text.to_string()).with_context(|| format!("{source}: the chat template does not compile"))?;
        Ok(ChatTemplate { env, bos_token, eos_token, source: source.to_string() })
    }

    /// The prompt text of `messages`, ending where the assistant's answer starts.
    pub fn render(&self, messages: &[Message]) -> Result<String> {
        let tmpl = self.env.get_template("chat").expect("added in new");
        let ctx = minijinja::context! {
            messages => messages,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            add_generation_prompt => true,
        };
        tmpl.render(ctx).map_err(|e| anyhow::anyhow!("the chat template ({}) failed on these messages: {e}", self.source))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn msgs() -> Vec<Message> {
        vec![Message { role: "system".into(), content: " Be brief. ".into() }, Message { role: "user".into(), content: "Hi".into() }]
    }

    #[test]
    fn a_chatml_template_from_the_tokenizer_settings_renders_with_python_methods() {
        let t = r#"{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}
{{ m['content'] | trim if m.role == 'system' else m.content.strip() }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"#;
        let settings = serde_json::json!({"chat_template": t, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}).to_string();
        let c = ChatTemplate::from_files(&files(&[("tokenizer_config.json", &settings)])).unwrap().unwrap();
        assert_eq!(
            c.render(&msgs()).unwrap(),
            "<s><|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn the_separate_template_file_wins_and_a_named_list_takes_default() {
        let settings = serde_json::json!({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}], "eos_token": "E"}).to_string();
        let c = ChatTemplate::from_files(&files(&[("tokenizer_config.json", &settings)])).unwrap().unwrap();
        assert_eq!(c.render(&msgs()).unwrap(), "DE");
        let c = ChatTemplate::from_files(&files(&[("tokenizer_config.json", &settings), ("chat_template.jinja", "J")])).unwrap().unwrap();
        assert_eq!(c.render(&msgs()).unwrap(), "J");
        assert!(ChatTemplate::from_files(&files(&[])).unwrap().is_none());
    }

    #[test]
    fn raise_exception_and_a_broken_template_are_errors_naming_the_source() {
        let t = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be the user') }}{% endif %}";
        let c = ChatTemplate::new(t, "tokenizer_config.json", String::new(), String::new()).unwrap();
        let e = c.render(&msgs()).unwrap_err().to_string();
        assert!(e.contains("first message must be the user") && e.contains("tokenizer_config.json"), "{e}");
        let e = ChatTemplate::new("{% for %}", "chat_template.jinja", String::new(), String::new()).err().unwrap();
        assert!(format!("{e:#}").contains("chat_template.jinja"), "{e:#}");
    }
}
