"""Does a Hugging Face architecture keep attention inside each example packed into a row?

Why a check, not a list: packed rows are passed with position ids that restart at each example and no attention
mask; transformers then builds a block-diagonal causal mask on the models built on its masking utilities (Llama,
Mistral, Qwen, Gemma, Phi, GPT-2, GPT-NeoX, ...), while others (OPT, BLOOM) take their positions from the attention
mask and attend across examples, silently. Which is which changes with transformers' releases, so it is measured:
a two-layer model of the same architecture (its config class at a tiny size, random weights) runs two examples
packed into one row and each alone, and the logits must agree. It takes a fraction of a second, on the CPU.
"""

from __future__ import annotations

import torch

_TINY = dict(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=2,
             max_position_embeddings=32, head_dim=8, n_layer=2, n_embd=16, n_head=2, n_positions=32, ffn_dim=32,
             word_embed_proj_dim=16, vocab_size=50, bos_token_id=None, eos_token_id=None, pad_token_id=None,
             tie_word_embeddings=False)


def attends_within_examples(model_type: str) -> bool | None:
    """True where `model_type` keeps each packed example's attention to itself, False where it attends across,
    None where no tiny model of it could be built (unknown)."""
    import transformers

    try:
        cfg = transformers.AutoConfig.for_model(model_type, **_TINY)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
        g = torch.Generator().manual_seed(0)
        a, b = torch.randint(0, 50, (1, 5), generator=g), torch.randint(0, 50, (1, 4), generator=g)
        row = torch.cat([a, b, torch.zeros(1, 3, dtype=torch.long)], 1)  # and padding: an example of its own
        positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0, 1, 2]])
        with torch.no_grad():
            packed = model(input_ids=row, position_ids=positions, use_cache=False).logits
            alone_a = model(input_ids=a, use_cache=False).logits
            alone_b = model(input_ids=b, use_cache=False).logits
    except Exception:  # noqa: BLE001 - an architecture whose tiny config cannot be built: not known either way
        return None
    return bool(torch.allclose(packed[:, :5], alone_a, atol=1e-5) and torch.allclose(packed[:, 5:9], alone_b,
                                                                                       atol=1e-5))


def check_packing(cfg) -> str:
    """How the run's model keeps packed examples apart, said in a few words; a one-line --packing error where it
    would attend across them (or cannot be checked)."""
    from tightfit.errors import UsageError
    from tightfit.models.build import hf_path

    folder = hf_path(cfg.model.model)
    if folder is None:
        return "the reference GPT's own block-diagonal mask"
    from tightfit.models.hf_load import HFCheckpoint

    config = HFCheckpoint.open(folder).config
    model_type = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config, "model_type",
                         None) or config.model_type
    verdict = attends_within_examples(model_type)
    if verdict:
        return f"position ids restarting at each example (checked on a tiny {model_type})"
    why = "attends across examples packed into a row (its attention ignores restarting position ids)" \
        if verdict is False else "could not be checked for attention within packed examples"
    raise UsageError(f"--packing: the {model_type} model of {folder} {why}; pass --no-packing (one example a row)")
