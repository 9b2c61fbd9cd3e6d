//! Tests of the Hugging Face GPT-2 export.

use std::fs;

use super::*;

fn tiny_cfg() -> Gpt2ExportConfig {
    Gpt2ExportConfig::new(11, 8, 4, 2, 2)
}

fn gpt2_params(cfg: &Gpt2ExportConfig) -> Vec<NamedTensor> {
    gpt2_expected_tensors(cfg)
        .into_iter()
        .enumerate()
        .map(|(k, (name, shape))| {
            let n: usize = shape.iter().product();
            let data = (0..n).map(|i| (k * 1000 + i) as f32 * 0.001 - 0.3).collect();
            NamedTensor { name, shape, data }
        })
        .collect()
}

#[test]
fn export_round_trip_names_shapes_data_and_config() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("hf");
    let cfg = tiny_cfg();
    let mut params = gpt2_params(&cfg);
    params.reverse(); // export must not depend on input order
    let mut head = params.iter().find(|t| t.name == "wte.weight").unwrap().clone();
    head.name = "lm_head.weight".into();
    params.push(head);
    export_hf_gpt2(&out, &params, &cfg, Some(&ExportReference { tokens: &[1, 5, 10, 2], loss: 2.25, text: None }), &[]).unwrap();

    let bytes = fs::read(out.join("model.safetensors")).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let format = meta.metadata().as_ref().and_then(|m| m.get("format").cloned());
    assert_eq!(format.as_deref(), Some("pt"));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let expected = gpt2_expected_tensors(&cfg);
    assert_eq!(expected.len(), 2 + 12 * 2 + 2);
    assert_eq!(st.len(), expected.len());
    assert!(st.tensor("lm_head.weight").is_err());
    for (name, shape) in &expected {
        let view = st.tensor(name).unwrap();
        assert_eq!(view.shape(), shape.as_slice(), "{name}");
        let src = params.iter().find(|t| &t.name == name).unwrap();
        let got: Vec<f32> = view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        assert_eq!(got, src.data, "{name}");
    }
    assert_eq!(st.tensor("h.1.attn.c_attn.weight").unwrap().shape(), &[4, 12]);
    assert_eq!(st.tensor("h.0.mlp.c_proj.weight").unwrap().shape(), &[16, 4]);

    let config: serde_json::Value = serde_json::from_slice(&fs::read(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "gpt2");
    assert_eq!(config["architectures"], serde_json::json!(["GPT2LMHeadModel"]));
    assert_eq!(config["activation_function"], "gelu_new");
    assert!(config["n_inner"].is_null());
    assert_eq!(config["tie_word_embeddings"], true);
    for (k, v) in [("vocab_size", 11), ("n_positions", 8), ("n_embd", 4), ("n_layer", 2), ("n_head", 2), ("eos_token_id", 10)] {
        assert_eq!(config[k], v, "{k}");
    }
    for k in ["resid_pdrop", "embd_pdrop", "attn_pdrop"] {
        assert_eq!(config[k], 0.0, "{k}");
    }
    assert_eq!(config["layer_norm_epsilon"], 1e-5);

    let reference: serde_json::Value = serde_json::from_slice(&fs::read(out.join("reference.json")).unwrap()).unwrap();
    assert_eq!(reference["tokens"], serde_json::json!([1, 5, 10, 2]));
    assert_eq!(reference["loss"], 2.25);
    // exporting again over the same directory replaces the files
    export_hf_gpt2(&out, &params, &cfg, None, &[]).unwrap();
    assert!(fs::read_dir(&out).unwrap().all(|e| !e.unwrap().file_name().to_string_lossy().contains(".tmp")));
}

#[test]
fn export_reports_missing_mismatched_and_foreign_tensors() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_cfg();
    let mut params = gpt2_params(&cfg);
    params.retain(|t| t.name != "h.1.mlp.c_fc.bias");
    let msg = export_hf_gpt2(tmp.path(), &params, &cfg, None, &[]).unwrap_err().to_string();
    assert!(msg.contains("missing tensor `h.1.mlp.c_fc.bias`") && msg.contains("[16]"), "{msg}");

    let mut params = gpt2_params(&cfg);
    let t = params.iter_mut().find(|t| t.name == "h.0.attn.c_proj.weight").unwrap();
    t.shape = vec![2, 8];
    let msg = export_hf_gpt2(tmp.path(), &params, &cfg, None, &[]).unwrap_err().to_string();
    assert!(msg.contains("h.0.attn.c_proj.weight") && msg.contains("[2, 8]") && msg.contains("[4, 4]"), "{msg}");

    let mut params = gpt2_params(&cfg);
    params.push(NamedTensor { name: "layers.0.attention.wq.weight".into(), shape: vec![1], data: vec![0.0] });
    let msg = export_hf_gpt2(tmp.path(), &params, &cfg, None, &[]).unwrap_err().to_string();
    assert!(msg.contains("layers.0.attention.wq.weight") && msg.contains("GPT-2"), "{msg}");

    let mut params = gpt2_params(&cfg);
    let mut head = params[0].clone();
    head.name = "lm_head.weight".into();
    head.data[3] += 1.0;
    params.push(head);
    assert!(export_hf_gpt2(tmp.path(), &params, &cfg, None, &[]).unwrap_err().to_string().contains("lm_head"));
    assert!(!tmp.path().join("model.safetensors").exists());
}

#[test]
fn export_validates_reference_and_config() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = tiny_cfg();
    let params = gpt2_params(&cfg);
    let msg = export_hf_gpt2(tmp.path(), &params, &cfg, Some(&ExportReference { tokens: &[1, 11], loss: 1.0, text: None }), &[])
        .unwrap_err()
        .to_string();
    assert!(msg.contains("11") && msg.contains("vocab_size"), "{msg}");
    assert!(export_hf_gpt2(tmp.path(), &params, &cfg, Some(&ExportReference { tokens: &[1], loss: 1.0, text: None }), &[]).is_err());
    assert!(export_hf_gpt2(tmp.path(), &params, &cfg, Some(&ExportReference { tokens: &[1, 2], loss: f32::NAN, text: None }), &[]).is_err());
    let mut bad = cfg.clone();
    bad.n_head = 3;
    assert!(export_hf_gpt2(tmp.path(), &params, &bad, None, &[]).unwrap_err().to_string().contains("n_head"));
    assert_eq!(Gpt2ExportConfig::new(50257, 1024, 768, 12, 12).bos_token_id, 50256);
    assert_eq!(Gpt2ExportConfig::new(50304, 1024, 768, 12, 12).eos_token_id, 50256);
}
