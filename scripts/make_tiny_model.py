"""Write the tiny random model the README's `hwkv generate` examples use: a Hugging Face folder, offline.

    python scripts/make_tiny_model.py tiny-gpt-oss                    # GPT-OSS, 4 layers, W=8, char tokenizer
    hwkv generate --model tiny-gpt-oss --prompt "Hello there" --max-new-tokens 16
    python scripts/make_tiny_model.py tiny-gpt-oss-ids --no-tokenizer # prompts are token ids: --prompt "1,2,3"
    python scripts/make_tiny_model.py tiny-mimo --arch mimo-v2        # MiMo-V2-Flash's attention layout

The folder holds config.json, the weights (safetensors, fp32) and generation_config.json, and unless
--no-tokenizer a character tokenizer (tokenizer.json: one token per printable ASCII character, <unk> for
anything else; built here with `tokenizers`, nothing downloaded), so prompts are text and outputs print as
characters. The shapes are the tests' (tests/test_transformers_integration.py): hidden 64, 4 heads (2 KV
heads) of 16, 4 layers alternating sliding (W = --window) and full for GPT-OSS, 4 experts top-2, a vocabulary
of 96 (the tokenizer's), no EOS (generation always runs to --max-new-tokens). Weights are drawn here from one
seeded generator (normal, std 0.3; norm weights 1) in the order of the sorted parameter names, not by
transformers' initialisers, so the same --seed gives the same model under any transformers version that names
its parameters the same way.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Dict

CHARS = ["<unk>"] + [chr(i) for i in range(32, 127)]  # token id = index: <unk> and printable ASCII
VOCAB = len(CHARS)
STD = 0.3


def _common(layers: int) -> Dict[str, Any]:
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                tie_word_embeddings=False, eos_token_id=None, pad_token_id=None, bos_token_id=None)


def _gpt_oss(t: Any, layers: int, window: int) -> Any:
    cfg = t.GptOssConfig(**_common(layers), sliding_window=window, num_local_experts=4, num_experts_per_tok=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return cfg


def _gemma3(t: Any, layers: int, window: int) -> Any:
    return t.Gemma3TextConfig(**_common(layers), sliding_window=window, query_pre_attn_scalar=16,
                              layer_types=["full_attention" if i % 4 == 3 else "sliding_attention"
                                           for i in range(layers)])


def _mimo_v2(t: Any, layers: int, window: int) -> Any:
    if not hasattr(t, "MiMoV2FlashConfig"):
        raise SystemExit(f"transformers {t.__version__} has no MiMo-V2-Flash model (MiMoV2FlashConfig)")
    common = {**_common(layers), "head_dim": 24}  # K head dim 24, V head dim 8, as MiMo-V2's 192 / 128 differ
    return t.MiMoV2FlashConfig(**common, v_head_dim=8, sliding_window=window, moe_intermediate_size=32,
                               n_routed_experts=4, num_experts_per_tok=2)


ARCHS: Dict[str, Callable[[Any, int, int], Any]] = {"gpt-oss": _gpt_oss, "gemma3": _gemma3, "mimo-v2": _mimo_v2}


def char_tokenizer() -> Any:
    """A fast tokenizer with one token per character of CHARS (no merges; <unk> for the rest): works offline."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def fill_weights(model: Any, seed: int) -> None:
    """Every parameter from one seeded generator, in sorted-name order: normal(0, STD), norm weights 1."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * STD)


def make(out: Path, arch: str = "gpt-oss", seed: int = 0, layers: int = 4, window: int = 8,
         tokenizer: bool = True) -> Path:
    """Write the model (and tokenizer) to `out`; returns `out`."""
    import torch
    import transformers

    if arch not in ARCHS:
        raise SystemExit(f"unknown --arch {arch!r}; choose one of {', '.join(ARCHS)}")
    cfg = ARCHS[arch](transformers, layers, window)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    fill_weights(model, seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if tokenizer:
        char_tokenizer().save_pretrained(out)
    return out


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="the folder to write (created; files in it are overwritten)")
    p.add_argument("--arch", default="gpt-oss", choices=sorted(ARCHS), help="default gpt-oss")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--window", type=int, default=8, help="sliding window of the SWA layers (default 8)")
    p.add_argument("--no-tokenizer", action="store_true", help="no tokenizer: `hwkv generate` prompts are token ids")
    args = p.parse_args(argv)
    if not args.out.strip():  # an unset shell variable ("$DIR") would write into the current folder
        p.error("the folder name is empty (give a folder to write; '.' for the current one)")
    args.out = Path(args.out)
    for flag, value, low in (("--layers", args.layers, 1), ("--window", args.window, 1), ("--seed", args.seed, 0)):
        if value < low:  # (0 layers or W=0 would write a model `hwkv generate` then refuses)
            p.error(f"{flag} must be >= {low}, got {value}")
        top = 64 if flag == "--seed" else 63  # torch's generator takes seeds below 2**64; generate W below 2**63
        if value >= 2 ** top:
            p.error(f"{flag} must be below 2**{top}, got {value}")
    if args.layers > 64:
        p.error(f"--layers must be <= 64 for a tiny model, got {args.layers}")
    if args.out.exists() and not args.out.is_dir():
        p.error(f"{args.out} exists and is not a folder")
    try:
        make(args.out, args.arch, args.seed, args.layers, args.window, tokenizer=not args.no_tokenizer)
    except OSError as e:  # a folder that cannot be made or written
        p.exit(2, f"{p.prog}: error: cannot write {args.out}: {e.strerror or e}\n")
    prompt = "1,2,3" if args.no_tokenizer else "Hello there"
    print(f"wrote {args.out}: {args.arch}, {args.layers} layers, W={args.window}, vocabulary {VOCAB}, "
          f"{'no tokenizer' if args.no_tokenizer else 'character tokenizer'}, seed {args.seed}\n"
          f"try: hwkv generate --model {args.out} --prompt {prompt!r} --max-new-tokens 16")
    return 0


if __name__ == "__main__":
    sys.exit(main())
