#!/usr/bin/env python3
"""Check a Tessera export (GPT-2, LLaMA, Mistral, Qwen2, Mixtral or Qwen2-MoE folder) against Hugging Face transformers.

Usage: check_export.py EXPORT_DIR [REFERENCE_JSON]

EXPORT_DIR is what `tessera export` wrote (model.safetensors or shards + index, config.json).
REFERENCE_JSON (default EXPORT_DIR/reference.json) is {"tokens": [...], "loss": x} where x is the
mean cross-entropy Tessera computed for predicting tokens[t+1] from tokens[:t+1] -- exactly what
AutoModelForCausalLM(input_ids=tokens, labels=tokens).loss computes -- for a mixture-of-experts model
whose config has `output_router_logits`, that `loss` also holds `router_aux_loss_coef * aux_loss`
(transformers adds the load-balancing loss then), which is taken out again: Tessera's reference
is the cross-entropy.

Loads the directory with AutoModelForCausalLM.from_pretrained (the class config.json names), fails if any weight is missing or
unexpected, and checks the loss agrees within 1e-4 relative. When REFERENCE_JSON also holds
{"text": ..., "text_ids": [...], "text_decoded": ...} (the ids Tessera's tokenizer gives the text,
and the text Tessera decodes them to), loads the export's tokenizer with `tokenizers`
(tokenizer.json) and with transformers' AutoTokenizer (which reads tokenizer_config.json too) and
checks both give those ids, and that AutoTokenizer decodes them to the same text.

Each check needs its packages: the tokenizer check `tokenizers` and `transformers` (no torch),
the model check `transformers` and `torch`; a check whose packages are missing prints SKIP.
Exit 0 when every check that ran passed, 1 on mismatch or error.
"""
import json
import math
import os
import sys

REL_TOL = 1e-4
# Buffers GPT-2 rebuilds itself (causal mask) -- their absence is not an export error.
IGNORED_MISSING_SUFFIXES = (".attn.bias", ".attn.masked_bias", "lm_head.weight")


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def load_reference(path):
    try:
        with open(path) as f:
            ref = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"cannot read reference {path}: {e}")
    tokens, loss = ref.get("tokens"), ref.get("loss")
    if not isinstance(tokens, list) or len(tokens) < 2 or not all(isinstance(t, int) for t in tokens):
        fail(f"{path}: key 'tokens' must be a list of at least 2 integers")
    if not isinstance(loss, (int, float)) or not math.isfinite(loss):
        fail(f"{path}: key 'loss' must be a finite number, found {loss!r}")
    return tokens, float(loss)


def check_loading_info(info):
    missing = [k for k in info.get("missing_keys", []) if not k.endswith(IGNORED_MISSING_SUFFIXES)]
    unexpected = list(info.get("unexpected_keys", []))
    mismatched = list(info.get("mismatched_keys", []))
    if missing or unexpected or mismatched:
        fail(f"weights did not load cleanly: missing={missing} unexpected={unexpected} mismatched={mismatched}")


def check_tokenizer(export_dir, ref_path):
    with open(ref_path) as f:
        ref = json.load(f)
    text, want = ref.get("text"), ref.get("text_ids")
    if text is None:
        print("SKIP tokenizer: the reference holds no sample text (an export of an older Tessera)")
        return
    try:
        from tokenizers import Tokenizer
        from transformers import AutoTokenizer
    except ImportError as e:
        print(f"SKIP tokenizer: {e.name} not installed (pip install tokenizers transformers)")
        return
    try:
        raw = Tokenizer.from_file(os.path.join(export_dir, "tokenizer.json"))
        auto = AutoTokenizer.from_pretrained(export_dir)
    except Exception as e:  # noqa: BLE001 -- report any loader failure as a check failure
        fail(f"loading the tokenizer of {export_dir!r} failed: {e}")
    got_raw = raw.encode(text, add_special_tokens=False).ids
    got_auto = auto.encode(text, add_special_tokens=False)
    for name, got in (("tokenizers.Tokenizer", got_raw), ("AutoTokenizer", got_auto)):
        if got != want:
            fail(f"{name} encodes the sample to {got[:16]}... ({len(got)} ids), tessera to {want[:16]}... ({len(want)} ids)")
    decoded = ref.get("text_decoded", text)
    back = auto.decode(want)
    if back != decoded:
        fail(f"AutoTokenizer decodes tessera's ids to {back!r}, tessera to {decoded!r}")
    print(f"OK: tokenizer ({type(auto).__name__}, vocab {len(auto)}) gives tessera's {len(want)} ids for the sample and decodes them back")


def main():
    if len(sys.argv) not in (2, 3):
        print(__doc__)
        sys.exit(1)
    export_dir = sys.argv[1]
    ref_path = sys.argv[2] if len(sys.argv) == 3 else os.path.join(export_dir, "reference.json")
    tokens, expected = load_reference(ref_path)
    check_tokenizer(export_dir, ref_path)
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        print(f"SKIP model: {e.name} not installed (pip install torch transformers)")
        sys.exit(0)
    try:
        # f32 arithmetic on whatever dtype the weights were written in (bf16 weights widen
        # exactly), as Tessera's reference loss is computed.
        model, info = AutoModelForCausalLM.from_pretrained(
            export_dir, output_loading_info=True, attn_implementation="eager", dtype=torch.float32
        )
    except Exception as e:  # noqa: BLE001 -- report any loader failure as a check failure
        fail(f"AutoModelForCausalLM.from_pretrained({export_dir!r}) failed: {e}")
    print(f"loaded {type(model).__name__}")
    check_loading_info(info)
    model = model.float().eval()
    ids = torch.tensor([tokens], dtype=torch.long)
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
        loss = out.loss
        if getattr(model.config, "output_router_logits", False) and getattr(out, "aux_loss", None) is not None:
            loss = loss - model.config.router_aux_loss_coef * out.aux_loss.to(loss.device)
        loss = float(loss)
    rel = abs(loss - expected) / max(abs(expected), 1e-12)
    if not rel <= REL_TOL:
        fail(f"loss mismatch: transformers {loss:.7f} vs tessera {expected:.7f} (rel {rel:.2e} > {REL_TOL:g})")
    print(f"OK: transformers loss {loss:.7f} matches tessera {expected:.7f} (rel {rel:.2e})")
    sys.exit(0)


if __name__ == "__main__":
    main()
