"""Hugging Face LLaMA -> models.llama parity: logits of a random HF model, saved and converted."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# The parity tests need the reference implementation; see README "Hugging Face parity tests".
HF_TEST = ("pip install torch --index-url https://download.pytorch.org/whl/cpu && "
           "pip install -e '.[dev,hf-test]'")
torch = pytest.importorskip("torch", reason=HF_TEST)
transformers = pytest.importorskip("transformers", reason=HF_TEST)

from models import convert_hf  # noqa: E402
from models.llama import LlamaConfig, rope_inv_freq  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _hf_model(tmp_path, *, tie: bool, rope_scaling, shard: bool, seed: int = 0, name="hf",
              **config):
  """A small random LlamaForCausalLM with GQA (4 query heads, 2 kv heads), saved as safetensors.

  ``config``: LlamaConfig fields replacing the defaults (e.g. ``hidden_size=64``).
  """
  torch.manual_seed(seed)
  kwargs = dict(vocab_size=96, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                rms_norm_eps=1e-5, tie_word_embeddings=tie, initializer_range=0.3,
                rope_theta=500.0)
  kwargs.update(config)
  if rope_scaling is not None:
    kwargs["rope_scaling"] = dict(rope_scaling)
  config = transformers.LlamaConfig(**kwargs)
  model = transformers.LlamaForCausalLM(config).eval()
  # Norm weights start at 1: perturb them so a mis-mapped norm cannot go unnoticed.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.add_(0.3 * torch.randn_like(p))
  out = tmp_path / name
  model.save_pretrained(out, safe_serialization=True, max_shard_size="20KB" if shard else "1GB")
  return model, str(out)


def _hf_logits(model, tokens_BL):
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens_BL), dtype=torch.long)).logits.numpy()


def _hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
  """transformers' greedy ``generate`` continuation of one prompt (no EOS stop)."""
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  with torch.no_grad():
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
  return out[0, len(prompt):].tolist()


def _ring_logits(params, cfg, mesh, tokens_BL):
  """Our float32 logits of ``tokens_BL`` (natural order): the model of ``cfg`` on ``mesh``,
  inputs put in ``cfg.layout`` over the mesh's ``sequence`` axis as the train step does."""
  from flax import nnx

  import ring_jax
  from models.llama import Llama

  graphdef = nnx.graphdef(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))
  ring = mesh.shape["sequence"]
  positions_BL = np.broadcast_to(np.arange(tokens_BL.shape[1]), tokens_BL.shape)
  to = lambda x: np.asarray(ring_jax.to_layout(x, cfg.layout, ring))
  with jax.set_mesh(mesh):
    logits = jax.jit(lambda p, t, q: nnx.merge(graphdef, p)(t, q))(params, to(tokens_BL),
                                                                    to(positions_BL))
  return np.asarray(ring_jax.from_layout(np.asarray(logits), cfg.layout, ring))


@pytest.mark.parametrize("tie,rope_scaling,shard", [
    (False, LLAMA3_ROPE, True),
    (True, None, False),
])
def test_logits_match_hugging_face(tmp_path, tie, rope_scaling, shard):
  model, path = _hf_model(tmp_path, tie=tie, rope_scaling=rope_scaling, shard=shard)
  if shard:  # the sharded-index path really is exercised
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
      assert len(set(json.load(f)["weight_map"].values())) > 1
  cfg = convert_hf.load_hf_config(path, attention="dense")
  assert (cfg.num_heads, cfg.num_kv_heads, cfg.tie_embeddings) == (4, 2, tie)
  if rope_scaling is None:
    assert cfg.rope_scaling is None
  else:
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_scaling["factor"] == 8.0
  assert cfg.rope_theta == 500.0
  ours = convert_hf.load_hf_checkpoint(path, cfg)

  rng = np.random.default_rng(0)
  tokens_BL = rng.integers(0, cfg.vocab_size, size=(2, 40))  # beyond original_max_position (16)
  positions_BL = np.broadcast_to(np.arange(40), tokens_BL.shape)
  expected = _hf_logits(model, tokens_BL)
  got = np.asarray(jax.jit(lambda m, t, p: m(t, p))(ours, tokens_BL, positions_BL))
  assert got.dtype == np.float32
  assert np.abs(expected).max() > 1.0  # non-trivial logits
  # float32 tolerance for logits of magnitude ~3 (a wrong weight mapping is off by O(1)).
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_inverse_frequencies_match_hugging_face():
  """Our llama3-scaled inv_freq equals HF's _compute_llama3_parameters (all three bands hit)."""
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  hf_cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=2, rope_theta=10000.0,
                                    rope_scaling=dict(LLAMA3_ROPE, original_max_position_embeddings=256))
  expected, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
  assert attention_factor == 1.0
  cfg = LlamaConfig(dim=256, num_heads=2, rope_theta=10000.0,
                    rope_scaling=dict(LLAMA3_ROPE, original_max_position_embeddings=256))
  got = rope_inv_freq(cfg)
  base = rope_inv_freq(LlamaConfig(dim=256, num_heads=2))
  ratio = base / got
  # Low frequencies divided by 8, high ones kept, some smoothly in between.
  assert np.any(np.isclose(ratio, 8.0)) and np.any(np.isclose(ratio, 1.0))
  assert np.any((ratio > 1.01) & (ratio < 7.99))
  np.testing.assert_allclose(got, expected.numpy(), rtol=1e-6)


def test_sharded_load_matches_unsharded(tmp_path):
  """mesh= places every parameter by the rules table, with the same values."""
  _, path = _hf_model(tmp_path, tie=False, rope_scaling=None, shard=False)
  plain = convert_hf.load_hf_checkpoint(path, attention="dense")
  mesh = jax.make_mesh((2, 2, 2), ("data", "tensor", "sequence"))
  sharded = convert_hf.load_hf_checkpoint(path, attention="dense", mesh=mesh)
  wq = sharded.layers.attn.wq[...]
  assert wq.sharding.spec == jax.P(None, None, "tensor", None)
  assert sharded.lm_head[...].sharding.spec == jax.P(None, "tensor")
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(sharded)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_config_errors(tmp_path):
  _, path = _hf_model(tmp_path, tie=False, rope_scaling=None, shard=False)
  # A config whose shapes disagree with the checkpoint is rejected, not silently loaded.
  cfg = convert_hf.load_hf_config(path, mlp_dim=64)
  with pytest.raises(ValueError, match="shape"):
    convert_hf.load_hf_checkpoint(path, cfg)
  # Tied config for an untied checkpoint: lm_head.weight would be ignored silently.
  with pytest.raises(ValueError, match="not used"):
    convert_hf.load_hf_checkpoint(path, tie_embeddings=True)
  with pytest.raises(FileNotFoundError):
    convert_hf.HFCheckpoint(str(tmp_path))


def test_bfloat16_checkpoint(tmp_path):
  """A bfloat16 checkpoint (the usual release format) reads without torch, bit-exact."""
  model, _ = _hf_model(tmp_path, tie=False, rope_scaling=None, shard=False)
  model = model.to(torch.bfloat16)
  path = str(tmp_path / "bf16")
  model.save_pretrained(path, safe_serialization=True)
  ours = convert_hf.load_hf_checkpoint(path, attention="dense", param_dtype="bfloat16")
  assert ours.layers.attn.wq[...].dtype == jnp.bfloat16
  hf_q = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()  # [N*H, D]
  ours_q = np.asarray(ours.layers.attn.wq[...][1].astype(jnp.float32))  # [D, N, H]
  np.testing.assert_array_equal(ours_q, hf_q.reshape(4, 8, 32).transpose(2, 0, 1))
  hf_down = model.model.layers[0].mlp.down_proj.weight.detach().float().numpy()  # [D, F]
  np.testing.assert_array_equal(np.asarray(ours.layers.mlp.w_down[...][0].astype(jnp.float32)),
                                hf_down.T)


@pytest.mark.parametrize("kv_heads,tie,rope_scaling,shard", [
    (2, False, None, True),  # GQA, sharded safetensors (index + several files)
    (4, True, None, False),  # tied embeddings, as many kv heads as query heads
    (2, False, LLAMA3_ROPE, False),  # LLaMA-3 RoPE scaling, positions past the original max
])
def test_ring_on_mesh_matches_hugging_face(tmp_path, kv_heads, tie, rope_scaling, shard):
  """load_hf_params straight into a (data=2, sequence=4) mesh's shardings; ring attention in
  the zigzag layout (as train.py runs it): logits equal transformers' (float32)."""
  from models import sharding as shd
  from training import mesh as mesh_lib

  model, path = _hf_model(tmp_path, tie=tie, rope_scaling=rope_scaling, shard=shard,
                          vocab_size=256, hidden_size=64, intermediate_size=128,
                          num_key_value_heads=kv_heads, initializer_range=0.1)
  mesh = mesh_lib.make_mesh(dict(data=2, sequence=4, tensor=1))
  cfg = convert_hf.load_hf_config(path, attention="ring", layout="zigzag", block_q=4,
                                  block_kv=4)
  params = convert_hf.load_hf_params(path, cfg, mesh=mesh)
  want = shd.param_shardings(params, mesh)
  for got, expected in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    assert got.sharding == expected
  tokens_BL = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 64))
  got = _ring_logits(params, cfg, mesh, tokens_BL)
  expected = _hf_logits(model, tokens_BL)
  assert np.abs(expected).max() > 1.0
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
