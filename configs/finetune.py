"""Fine-tune a local Hugging Face LLaMA with ring attention (e.g. to a longer context).

  python train.py --config configs/finetune.py --config.init.hf_dir=/path/to/hf_llama \\
      --config.data.path=/path/to/corpus.jsonl --workdir /tmp/ft
  python export_hf.py --workdir /tmp/ft --out /tmp/ft_hf

Every field of ``configs/common.py`` is here (``--config.mesh.*``,
``--config.data.seq_len``, ``--config.batch_size``, ``--config.optim.*`` work
as in the other configs). The model's shape and RoPE come from
``init.hf_dir/config.json``: the fields of
:data:`models.convert_hf.HF_FIELDS` (vocab_size, dim, num_layers, num_heads,
num_kv_heads, head_dim, mlp_dim, rope_theta, rope_scaling, norm_eps,
tie_embeddings, and the architecture fields qkv_bias, qk_norm, sliding_window, layer_types,
the Gemma fields mlp_activation, norm_unit_offset, post_norms, scale_embeddings,
query_pre_attn_scalar, attn_logits_soft_cap, final_logits_soft_cap, rope_local_theta, and
family) are None here, which means "take config.json's value".
Setting one is an override: ``--config.model.rope_theta=5e6`` trains with that
RoPE base (context extension), and export_hf.py writes it into the exported
config.json. The shape fields must equal config.json's (the weights fix them),
else the run stops with a config error before anything compiles. To turn a
checkpoint's RoPE scaling off, set ``model.rope_scaling = {"rope_type":
"default"}`` (None means "keep config.json's"); ``configs/finetune.py:yarn:4:32768``
sets YaRN (factor 4 over 32768 original positions). Fields HF does not know
(attention, layout, block sizes, remat_policy, dtype, param_dtype, ...) are
the usual ones of common.py.

``data.tokenizer`` defaults to the tokenizer in ``init.hf_dir`` (its
tokenizer.json or tokenizer.model); generate.py and evaluate.py use the same one
for the run's workdir.
"""

import ml_collections
from ml_collections import config_dict

from configs import common

# The types of models.convert_hf.HF_FIELDS (kept here: configs import no model code).
_HF_FIELD_TYPES = dict(vocab_size=int, dim=int, num_layers=int, num_heads=int, num_kv_heads=int,
                       head_dim=int, mlp_dim=int, rope_theta=float, rope_scaling=dict,
                       norm_eps=float, tie_embeddings=bool, qkv_bias=bool, qk_norm=bool,
                       sliding_window=int, layer_types=tuple, mlp_activation=str,
                       norm_unit_offset=bool, post_norms=bool, scale_embeddings=bool,
                       query_pre_attn_scalar=float, attn_logits_soft_cap=float,
                       final_logits_soft_cap=float, rope_local_theta=float, family=str)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  """``arg``: None, or ``"yarn:<factor>:<original_max_position_embeddings>"`` to train with
  YaRN RoPE scaling (Peng et al. 2023; e.g. ``configs/finetune.py:yarn:4:32768``, Qwen2.5's
  long-context setting), in place of the checkpoint's RoPE scaling."""
  rope_scaling = None
  if arg:
    kind, *values = arg.split(":")
    try:
      if kind != "yarn" or len(values) != 2:
        raise ValueError
      factor, original = float(values[0]), int(values[1])
    except ValueError:
      raise ValueError(f"configs/finetune.py takes no argument or "
                       f"'yarn:<factor>:<original_max_position_embeddings>' (e.g. "
                       f"'yarn:4:32768'), got {arg!r}.") from None
    rope_scaling = dict(rope_type="yarn", factor=factor,
                        original_max_position_embeddings=original)
  config = common.base_config()
  for name, kind in _HF_FIELD_TYPES.items():
    config.model[name] = config_dict.placeholder(kind)
  if rope_scaling is not None:
    config.model.rope_scaling = rope_scaling
  config.data.kind = "text"  # needs --config.data.path
  # None: the tokenizer in init.hf_dir (training/hf_init.py:resolve_hf_init fills it in, so
  # --config.init.hf_dir=DIR alone sets it and the run's saved config.json names the file);
  # --config.data.tokenizer=... (a file, a directory or "byte") overrides it.
  config.data.tokenizer = config_dict.placeholder(str)
  config.data.seq_len = 512
  config.batch_size = config.eval_batch_size = 8
  # Fine-tuning rates: a pretrained model diverges at from-scratch learning rates.
  config.total_steps = 200
  config.optim.lr = 2e-5
  config.optim.warmup_steps = 20
  config.optim.weight_decay = 0.0
  config.log_every = 10
  config.eval_every = 50
  config.checkpoint_every = 100
  # Context extension in stages (training/stages.py, docs/context_extension.md): each stage
  # starts from the previous one's checkpoint, with its own length, RoPE base and schedule;
  # total_steps becomes their sum. Or on the command line:
  # --config.stages="8192:500:rope_theta=1e6,32768:250:rope_theta=5e6:lr=1e-5".
  # config.stages = [
  #     dict(seq_len=8192, steps=500, rope_theta=1e6),
  #     dict(seq_len=32768, steps=250, rope_theta=5e6, lr=1e-5, warmup_steps=10),
  # ]
  return config
