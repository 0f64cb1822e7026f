"""Hugging Face LLaMA -> models.llama parity: logits of a random HF model, saved and converted."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# The parity tests need the reference implementation; see docs/development.md, "Running the tests".
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

  hf_cfg = transformers.LlamaConfig(
      hidden_size=256, num_attention_heads=2, rope_theta=10000.0,
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


# ----------------------------------------------------------------------------------------------
# Qwen2 / Qwen3 / Mistral, YaRN and dynamic-NTK RoPE
# ----------------------------------------------------------------------------------------------

YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}

#: One random tiny model per family (GQA everywhere): what each case switches on.
FAMILY_CASES = {
    # q/k/v biases, untied, a window of 8 on the second layer only (max_window_layers=1),
    # dynamic NTK past max_position_embeddings=32 (the rows are 64 tokens).
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1,
                  max_position_embeddings=32, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
    # q/k norms, head_dim 32 != 64 / 4, tied, YaRN (factor 4 over 16 original positions).
    "qwen3": dict(head_dim=32, tie_word_embeddings=True,
                  rope_parameters=dict(YARN_ROPE, rope_theta=1e4)),
    # a window of 8 on every layer, untied.
    "mistral": dict(sliding_window=8, tie_word_embeddings=False),
}


def hf_family_model(family: str, path: str, seed: int = 0, **overrides):
  """A random ``<Family>ForCausalLM`` of :data:`FAMILY_CASES` saved at ``path``."""
  classes = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}
  name = classes[family]
  torch.manual_seed(seed)
  kwargs = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                rms_norm_eps=1e-5, initializer_range=0.1)
  kwargs.update(FAMILY_CASES.get(family, {}), **overrides)
  config = getattr(transformers, f"{name}Config")(**kwargs)
  model = getattr(transformers, f"{name}ForCausalLM")(config).eval()
  with torch.no_grad():  # norms start at 1 and biases at 0: perturb them so they matter
    for pname, p in model.named_parameters():
      if "norm" in pname or "bias" in pname:
        p.add_(0.3 * torch.randn_like(p))
  model.save_pretrained(path, safe_serialization=True)
  return model


@pytest.fixture(scope="module")
def families(tmp_path_factory):
  """family -> (transformers model, its directory), each built once for the module."""
  tmp = tmp_path_factory.mktemp("families")
  return {f: (hf_family_model(f, str(tmp / f)), str(tmp / f)) for f in FAMILY_CASES}


def test_family_fields(families):
  """config.json -> the model's fields, as transformers resolves them."""
  qwen2 = convert_hf.load_hf_config(families["qwen2"][1])
  assert (qwen2.family, qwen2.qkv_bias, qwen2.qk_norm, qwen2.tie_embeddings) == (
      "qwen2", True, False, False)
  assert qwen2.layer_windows == (None, 8) and len(qwen2.layer_groups) == 2
  assert qwen2.rope_scaling == {"rope_type": "dynamic", "factor": 2.0,
                                "original_max_position_embeddings": 32}
  qwen3 = convert_hf.load_hf_config(families["qwen3"][1])
  assert (qwen3.family, qwen3.qk_norm, qwen3.resolved_head_dim, qwen3.tie_embeddings) == (
      "qwen3", True, 32, True)
  assert qwen3.layer_windows == (None, None) and qwen3.rope_scaling["rope_type"] == "yarn"
  mistral = convert_hf.load_hf_config(families["mistral"][1])
  assert mistral.family == "mistral" and mistral.layer_windows == (8, 8)
  assert mistral.layer_types is None and len(mistral.layer_groups) == 1


@pytest.mark.parametrize("family,layout", [("qwen2", "contiguous"), ("qwen3", "zigzag"),
                                           ("mistral", "contiguous")])
def test_family_ring_on_mesh_matches_hugging_face(families, family, layout):
  """Each family loaded onto a (data=2, sequence=4) mesh runs ring attention (windows on the
  ring's local window, pruning hops) with logits equal to transformers' at rtol 1e-4."""
  from training import mesh as mesh_lib

  model, path = families[family]
  mesh = mesh_lib.make_mesh(dict(data=2, sequence=4, tensor=1))
  cfg = convert_hf.load_hf_config(path, attention="ring", layout=layout, block_q=4, block_kv=4)
  params = convert_hf.load_hf_params(path, cfg, mesh=mesh)
  tokens_BL = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, 64))
  got = _ring_logits(params, cfg, mesh, tokens_BL)
  expected = _hf_logits(model, tokens_BL)
  assert np.abs(expected).max() > 1.0
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
  if family == "mistral":  # the window is not vacuous: without it the logits differ
    import dataclasses
    full = _ring_logits(params, dataclasses.replace(cfg, sliding_window=None), mesh, tokens_BL)
    assert np.abs(full - expected).max() > 1e-2


def test_family_tensor_parallel_matches_hugging_face(families):
  """qwen2 (biases split over the tensor peers with their heads, a mixed window stack) on
  data=2 x sequence=2 x tensor=2: transformers' logits."""
  from training import mesh as mesh_lib

  model, path = families["qwen2"]
  mesh = mesh_lib.make_mesh(dict(data=2, sequence=2, tensor=2))
  cfg = convert_hf.load_hf_config(path, attention="ring", layout="contiguous", block_q=8,
                                  block_kv=8)
  params = convert_hf.load_hf_params(path, cfg, mesh=mesh)
  assert params["layers"]["attn"]["bq"].sharding.spec[1:] == ("tensor", None)  # heads split
  tokens_BL = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(2, 64))
  np.testing.assert_allclose(_ring_logits(params, cfg, mesh, tokens_BL),
                             _hf_logits(model, tokens_BL), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("change,match", [
    (dict(model_type="gemma"), "model_type 'gemma' is not supported"),
    (dict(architectures=["LlamaForSequenceClassification"]), "architecture"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}), "rope_type 'longrope'"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
])
def test_unsupported_config_is_one_error_naming_it(families, tmp_path, change, match):
  hf = convert_hf.read_hf_config_json(families["qwen3"][1])
  hf.update(change)
  (tmp_path / "config.json").write_text(json.dumps(hf))
  with pytest.raises(ValueError, match=match):
    convert_hf.hf_model_fields(str(tmp_path))


def test_family_must_express_the_fields():
  """Export refuses a config its family cannot write, naming the family that could."""
  with pytest.raises(ValueError, match="qwen2 has them"):
    convert_hf.hf_config_dict(LlamaConfig(qkv_bias=True))
  with pytest.raises(ValueError, match="no sliding window"):
    convert_hf.hf_config_dict(LlamaConfig(sliding_window=8))
  with pytest.raises(ValueError, match="qwen2 and qwen3 take per-layer"):
    convert_hf.hf_config_dict(LlamaConfig(family="mistral", sliding_window=8,
                                          layer_types=("full_attention", "sliding_attention")))
  with pytest.raises(ValueError, match="family must be one of"):
    LlamaConfig(family="gemma")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_yarn_export_writes_consistent_positions(tmp_path, family):
  """YaRN (factor 4 over 64 original positions) exported from a source whose config.json has
  4096 positions: max_position_embeddings is original * factor (256), as transformers reads
  the factor back from it, and transformers loads the config without its implicit-factor
  warning; the import reads the same scaling back."""
  import logging

  yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
  cfg = LlamaConfig(family=family, qk_norm=family == "qwen3", rope_scaling=yarn)
  out = convert_hf.hf_config_dict(cfg, {"max_position_embeddings": 4096},
                                  max_position_embeddings=128)
  assert out["max_position_embeddings"] == 256 and out["rope_scaling"] == yarn
  (tmp_path / "config.json").write_text(json.dumps(out))
  records = []
  handler = logging.Handler()
  handler.emit = records.append
  hf_logger = logging.getLogger("transformers")
  hf_logger.addHandler(handler)
  try:
    loaded = transformers.AutoConfig.from_pretrained(str(tmp_path))
  finally:
    hf_logger.removeHandler(handler)
  assert not [r for r in records if "implicit factor" in r.getMessage()], records
  assert loaded.max_position_embeddings == 256
  assert convert_hf.hf_model_fields(str(tmp_path))["rope_scaling"] == yarn


@pytest.mark.newest_jax
def test_yarn_and_dynamic_rope_match_transformers():
  """inv_freq, attention factor and cos/sin of "yarn" (default, attention_factor, mscale /
  mscale_all_dim, truncate=False) and "dynamic" (at lengths below, at and above the original)
  equal transformers' ROPE_INIT_FUNCTIONS and its rotary embedding's forward."""
  import jax.numpy as jnp
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  from models.llama import rope_attention_factor, rope_tables

  def check(rope, seq_len=None, max_positions=64):
    hf_cfg = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2,
                                      max_position_embeddings=max_positions,
                                      rope_parameters=dict(rope, rope_theta=1e4))
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, "cpu", seq_len=seq_len)
    scaling = dict(rope)
    if rope["rope_type"] == "dynamic":
      scaling["original_max_position_embeddings"] = max_positions
    cfg = LlamaConfig(dim=128, num_heads=2, rope_theta=1e4, rope_scaling=scaling)
    ours = rope_inv_freq(cfg, seq_len)
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6)
    assert rope_attention_factor(cfg) == pytest.approx(factor, rel=1e-12)
    # cos/sin as transformers' rotary embedding forward computes them (times the factor);
    # float32 cos of angles up to ~1000 rad differs between implementations by ~1e-4.
    positions = np.arange(max(seq_len or 0, 80))[None]
    freqs = positions[..., None].astype(np.float32) * inv_freq.numpy()
    emb = np.concatenate([freqs, freqs], -1)
    cos, sin = rope_tables(jnp.asarray(positions), ours, rope_attention_factor(cfg))
    np.testing.assert_allclose(np.asarray(cos[:, :, 0]), np.cos(emb) * factor, atol=1e-4)
    np.testing.assert_allclose(np.asarray(sin[:, :, 0]), np.sin(emb) * factor, atol=1e-4)
    return ours

  base = rope_inv_freq(LlamaConfig(dim=128, num_heads=2, rope_theta=1e4))
  yarn = check(dict(YARN_ROPE))
  ratio = base / yarn  # fast channels kept, slow ones divided by 4, a ramp between
  assert np.isclose(ratio[0], 1.0) and np.isclose(ratio[-1], 4.0)
  assert np.any((ratio > 1.01) & (ratio < 3.99))
  check(dict(YARN_ROPE, beta_fast=16, beta_slow=2, truncate=False))
  check(dict(YARN_ROPE, attention_factor=0.8))
  check(dict(YARN_ROPE, factor=40.0, mscale=0.707, mscale_all_dim=0.707))  # DeepSeek's
  check(dict(YARN_ROPE, factor=40.0, mscale=1.0, mscale_all_dim=0.5))
  # Qwen2.5's long-context setting: factor 4 over 32768 original positions.
  check({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
        max_positions=131072)
  dynamic = {"rope_type": "dynamic", "factor": 2.0}
  for seq_len in (32, 64, 100, 256, 1000):
    got = check(dynamic, seq_len)
    assert np.array_equal(got, base) == (seq_len <= 64)
