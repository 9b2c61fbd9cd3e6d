//! Human renderings of the config layer: `tessera config check` output and the generated
//! docs/config.md (both from the key table).

use std::fmt::Write as _;

use crate::config::auto::AUTO_RULES;
use crate::config::keys::{self, key_table};
use crate::config::legacy::LEGACY_KEYS;
use crate::config::Config;

/// The resolved JSON (pretty) followed by a table of the keys present in the user's config
/// with honoured / not yet, then the warnings.
pub fn render_check(cfg: &Config) -> String {
    let mut out = String::new();
    let pretty = serde_json::to_string_pretty(&cfg.resolved).unwrap_or_else(|e| e.to_string());
    let _ = writeln!(out, "config {} (hash {})", cfg.source, cfg.hash);
    let _ = writeln!(out, "resolved:\n{pretty}\n");
    let width = cfg.present_keys.iter().map(String::len).max().unwrap_or(3).max(3);
    let _ = writeln!(out, "{:<width$}  {:<9}  note", "key", "status");
    for path in &cfg.present_keys {
        let status = if keys::effectively_honoured(path) { "honoured" } else { "not yet" };
        let note = keys::lookup(path).map_or("", |k| k.note);
        let line = format!("{path:<width$}  {status:<9}  {note}");
        let _ = writeln!(out, "{}", line.trim_end());
    }
    if !cfg.warnings.is_empty() {
        let _ = writeln!(out, "\nwarnings:");
        for w in &cfg.warnings {
            let _ = writeln!(out, "  - {w}");
        }
    }
    out
}

/// Escape a table cell for Markdown.
fn cell(s: &str) -> String {
    s.replace('|', "\\|")
}

/// The full text of docs/config.md, generated from the key table, the auto rules and the
/// legacy-key list. Regenerate the file with
/// `TESSERA_REGEN_DOCS=1 cargo test --lib config::tests::docs_in_sync`.
pub fn render_markdown_table() -> String {
    let mut out = String::from(DOC_HEADER);
    out.push_str("\n## Keys\n\n| Key | Type | Tessera | Notes |\n|---|---|---|---|\n");
    for k in key_table() {
        let status = if keys::effectively_honoured(k.path) { "honoured" } else { "not yet" };
        let _ = writeln!(out, "| `{}` | {} | {status} | {} |", k.path, k.kind.describe(), cell(k.note));
    }
    out.push_str("\n## `\"auto\"` values\n\n| Key | Resolved from |\n|---|---|\n");
    for (path, source) in AUTO_RULES {
        let _ = writeln!(out, "| `{path}` | {} |", cell(source.describe()));
    }
    out.push_str("\n## Legacy keys\n\n| Legacy key | Becomes |\n|---|---|\n");
    for (old, new) in LEGACY_KEYS {
        let _ = writeln!(out, "| `{old}` | {} |", cell(new));
    }
    out
}

const DOC_HEADER: &str = "\
# Tessera configuration reference

<!-- Generated from src/config/keys.rs by `config::render_markdown_table()`; do not edit.
     Regenerate: TESSERA_REGEN_DOCS=1 cargo test --lib config::tests::docs_in_sync -->

Tessera reads an unmodified DeepSpeed JSON config. Rules:

- **Batch rule**: `train_batch_size = train_micro_batch_size_per_gpu × gradient_accumulation_steps × world`.
  Missing values are derived as DeepSpeed does; inconsistent or non-divisible values are errors.
- **Numbers**: where an integer is expected, `5e8`, `5.0e8` and `\"5e8\"` all mean 500000000;
  non-integral values are errors.
- **Unknown keys** are errors, with the nearest valid key suggested. Known DeepSpeed keys that
  Tessera does not honour yet are accepted and reported as warnings (`tessera config check`
  lists them); `null`, `false`, `{\"enabled\": false}` and `{\"device\": \"none\"}` draw no warning,
  except for flags whose DeepSpeed default is `true` (what Tessera always does), where `false` warns
  and `true` does not.
- **`--device cuda`** reduces and gathers unit by unit: `zero_optimization.reduce_bucket_size` and
  the `stage3_*` tuning keys have no effect there, and a run that sets them is warned.
- **`\"auto\"`** values are filled from `--world`, `--steps` and the model (table below); all
  unresolved ones are reported together. `\"auto\"` in keys not honoured yet is kept as written.
- **`--set a.b.c=VALUE`** edits the JSON before validation (VALUE is JSON if it parses, else a string).
- **`tessera`** holds Tessera's own keys.
- The run's config hash is the blake3 of the resolved JSON with sorted keys.
";
