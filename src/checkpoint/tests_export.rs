//! Tests of the export's own pieces: `reference.json` and GPT-2's `config.json` (the weights'
//! layout is `crate::hf`'s, tested there).

use super::*;

#[test]
fn the_reference_is_validated_against_the_vocabulary() {
    let doc = reference_json(&ExportReference { tokens: &[1, 5, 10, 2], loss: 2.25, text: None }, 11).unwrap();
    let reference: serde_json::Value = serde_json::from_slice(&doc).unwrap();
    assert_eq!(reference["tokens"], serde_json::json!([1, 5, 10, 2]));
    assert_eq!(reference["loss"], 2.25);
    let msg = reference_json(&ExportReference { tokens: &[1, 11], loss: 1.0, text: None }, 11).unwrap_err().to_string();
    assert!(msg.contains("11") && msg.contains("vocab_size"), "{msg}");
    assert!(reference_json(&ExportReference { tokens: &[1], loss: 1.0, text: None }, 11).is_err());
    assert!(reference_json(&ExportReference { tokens: &[1, 2], loss: f32::NAN, text: None }, 11).is_err());
}

#[test]
fn gpt2_config_names_the_model_and_its_end_of_text() {
    let config = Gpt2ExportConfig::new(11, 8, 4, 2, 2).to_hf_json();
    assert_eq!(config["model_type"], "gpt2");
    assert_eq!(config["architectures"], serde_json::json!(["GPT2LMHeadModel"]));
    assert_eq!(config["activation_function"], "gelu_new");
    assert_eq!(config["tie_word_embeddings"], true);
    for (k, v) in [("vocab_size", 11), ("n_positions", 8), ("n_embd", 4), ("n_layer", 2), ("n_head", 2), ("eos_token_id", 10)] {
        assert_eq!(config[k], v, "{k}");
    }
    for k in ["resid_pdrop", "embd_pdrop", "attn_pdrop"] {
        assert_eq!(config[k], 0.0, "{k}");
    }
    assert_eq!(config["layer_norm_epsilon"], 1e-5);
    assert_eq!(Gpt2ExportConfig::new(50257, 1024, 768, 12, 12).bos_token_id, 50256);
    assert_eq!(Gpt2ExportConfig::new(50304, 1024, 768, 12, 12).eos_token_id, 50256);
}
