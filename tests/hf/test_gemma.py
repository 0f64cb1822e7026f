"""Gemma 2 and Gemma 3 (text) in and out of Hugging Face: logits equal transformers' on
random tiny models (dense and ring attention on a data=2 x sequence=4 mesh), import -> export
bitwise, and make_tiny_hf.py -> train.py (ring attention) -> export_hf.py -> transformers and
generate.py agree token for token."""

import dataclasses
import io
import json
import os

import jax
import numpy as np
import pytest

HF_TEST = ("pip install torch --index-url https://download.pytorch.org/whl/cpu && "
           "pip install -e '.[dev,hf-test]'")
torch = pytest.importorskip("torch", reason=HF_TEST)
transformers = pytest.importorskip("transformers", reason=HF_TEST)

import export_hf  # noqa: E402
from models import convert_hf  # noqa: E402
from models.llama import LlamaConfig  # noqa: E402
from test_convert_hf import _hf_greedy, _hf_logits, _ring_logits  # noqa: E402
from training import mesh as mesh_lib  # noqa: E402

MESH = dict(data=2, sequence=4, tensor=1)

#: One random tiny model per family: small soft-caps and windows so that every Gemma
#: feature changes the logits of a 64-token row (each checked not vacuous below).
GEMMA_CASES = {
    # Alternating windows of 8 (layers 0, 2), attention soft-cap 5, final soft-cap 3,
    # query_pre_attn_scalar 24 != head_dim 16.
    "gemma2": dict(attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    # 7 layers of 2 local : 1 global (sliding_window_pattern 3), the local layers' own RoPE
    # base (1e4) against the global layers' 1e6 with linear scaling x4, q/k norms, final
    # soft-cap 3.
    "gemma3": dict(sliding_window_pattern=3, final_logit_softcapping=3.0, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}


def hf_gemma_model(family: str, path: str, seed: int = 0):
  """A random ``Gemma2ForCausalLM`` / ``Gemma3ForCausalLM`` of :data:`GEMMA_CASES` saved at
  ``path`` (norm weights perturbed off 0, so a lost ``1 + w`` shows)."""
  torch.manual_seed(seed)
  kwargs = dict(vocab_size=256, hidden_size=64, intermediate_size=128,
                num_hidden_layers=4 if family == "gemma2" else 7,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=128, initializer_range=0.1, sliding_window=8,
                query_pre_attn_scalar=24, **GEMMA_CASES[family])
  if family == "gemma2":
    model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**kwargs))
  else:
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**kwargs))
  model = model.eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.add_(0.3 * torch.randn_like(p))
  model.save_pretrained(path, safe_serialization=True)
  return model


@pytest.fixture(scope="module")
def gemmas(tmp_path_factory):
  """family -> (transformers model, its directory), each built once for the module."""
  tmp = tmp_path_factory.mktemp("gemmas")
  return {f: (hf_gemma_model(f, str(tmp / f)), str(tmp / f)) for f in GEMMA_CASES}


def test_gemma_fields(gemmas):
  """config.json -> the model's fields, as transformers resolves them."""
  g2 = convert_hf.load_hf_config(gemmas["gemma2"][1])
  assert (g2.family, g2.mlp_activation, g2.norm_unit_offset, g2.post_norms,
          g2.scale_embeddings, g2.tie_embeddings, g2.qk_norm) == (
              "gemma2", "gelu_tanh", True, True, True, True, False)
  assert (g2.query_pre_attn_scalar, g2.attn_logits_soft_cap, g2.final_logits_soft_cap) == (
      24.0, 5.0, 3.0)
  assert g2.layer_windows == (8, None, 8, None) and g2.rope_local_theta is None
  # One scan over two repetitions of (local, global), not one scan per layer.
  assert g2.layer_segments == ((0, 4, (8, None)),)
  g3 = convert_hf.load_hf_config(gemmas["gemma3"][1])
  assert (g3.family, g3.qk_norm, g3.attn_logits_soft_cap, g3.final_logits_soft_cap) == (
      "gemma3", True, None, 3.0)
  assert g3.layer_windows == (8, 8, None, 8, 8, None, 8) and len(g3.layer_groups) == 5
  assert g3.layer_segments == ((0, 6, (8, 8, None)), (6, 7, (8,)))
  assert (g3.rope_theta, g3.rope_local_theta) == (1e6, 1e4)
  assert g3.rope_scaling == {"rope_type": "linear", "factor": 4.0}
  # transformers' model has the same per-layer windows.
  hf3 = gemmas["gemma3"][0].config
  assert [t == "sliding_attention" for t in hf3.layer_types] == [
      w is not None for w in g3.layer_windows]


@pytest.mark.parametrize("family,attention,layout,scan", [
    ("gemma2", "dense", "contiguous", True),
    ("gemma2", "ring", "zigzag", True),
    ("gemma3", "dense", "contiguous", False),
    ("gemma3", "ring", "contiguous", True),
])
def test_gemma_logits_match_transformers(gemmas, family, attention, layout, scan):
  """float32 logits of a 64-token batch equal transformers' (rtol/atol 1e-4): dense on one
  device (the layers scanned by pattern, or a Python loop), or ring attention (windows on the
  ring's local window) with the weights loaded straight into a data=2 x sequence=4 mesh's
  shardings."""
  model, path = gemmas[family]
  tokens_BL = np.random.default_rng(1).integers(0, 256, size=(2, 64))
  expected = _hf_logits(model, tokens_BL)
  assert np.abs(expected).max() > 1.0
  if attention == "dense":
    cfg = convert_hf.load_hf_config(path, attention="dense", scan_layers=scan)
    ours = convert_hf.load_hf_checkpoint(path, cfg)
    got = np.asarray(jax.jit(lambda m, t, p: m(t, p))(ours, tokens_BL, np.arange(64)))
  else:
    mesh = mesh_lib.make_mesh(MESH)
    cfg = convert_hf.load_hf_config(path, attention="ring", layout=layout, block_q=4,
                                    block_kv=4)
    params = convert_hf.load_hf_params(path, cfg, mesh=mesh)
    got = _ring_logits(params, cfg, mesh, tokens_BL)
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family,change", [
    ("gemma2", dict(attn_logits_soft_cap=None)),
    ("gemma2", dict(final_logits_soft_cap=None)),
    ("gemma2", dict(query_pre_attn_scalar=None)),
    ("gemma2", dict(scale_embeddings=False)),
    ("gemma2", dict(sliding_window=None, layer_types=None)),
    ("gemma3", dict(rope_local_theta=None)),
    ("gemma3", dict(norm_unit_offset=False)),
    ("gemma3", dict(post_norms=False)),
    ("gemma3", dict(mlp_activation="silu")),
])
def test_each_gemma_feature_matters(gemmas, family, change):
  """Turning any one Gemma field off moves the logits well past the tolerance above, so the
  parity test covers it (a missing feature cannot pass)."""
  model, path = gemmas[family]
  cfg = convert_hf.load_hf_config(path, attention="dense")
  params = convert_hf.load_hf_params(path, cfg)
  if "post_norms" in change:  # no tensors for the post-norms: drop them from the state
    params["layers"].pop("post_attn_norm")
    params["layers"].pop("post_mlp_norm")
  tokens_BL = np.random.default_rng(1).integers(0, 256, size=(2, 64))
  wrong = dataclasses.replace(cfg, **change)
  from flax import nnx

  from models.llama import Llama
  graphdef = nnx.graphdef(nnx.eval_shape(lambda: Llama(wrong, rngs=nnx.Rngs(0))))
  got = np.asarray(nnx.merge(graphdef, params)(tokens_BL, np.arange(64)))
  assert np.abs(got - _hf_logits(model, tokens_BL)).max() > 1e-2


def test_interleaved_stack_scans_by_pattern():
  """An interleaved stack of 7 layers, 2 local : 1 global (Gemma 3's pattern with
  ``sliding_window_pattern=3``), scans a 3-layer pattern twice, then a run of 1: logits and
  gradients equal the Python loop over the layers, and under full remat."""
  from flax import nnx

  from model_utils import random_params
  from models.llama import Llama

  types = tuple("full_attention" if (i + 1) % 3 == 0 else "sliding_attention"
                for i in range(7))
  cfg = LlamaConfig(vocab_size=64, dim=32, num_layers=7, num_heads=4, num_kv_heads=2,
                    mlp_dim=64, attention="dense", sliding_window=4, layer_types=types,
                    rope_local_theta=1e4, rope_theta=1e6, init_std=0.3)
  assert cfg.layer_segments == ((0, 6, (4, 4, None)), (6, 7, (4,)))
  # Gemma 3's own 5 : 1 over 26 layers (its 1B): four 6-layer patterns and a run of 2.
  gemma3_1b = LlamaConfig(num_layers=26, sliding_window=512, layer_types=tuple(
      "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(26)))
  assert gemma3_1b.layer_segments == ((0, 24, (512,) * 5 + (None,)), (24, 26, (512,)))
  params = random_params(cfg)
  tokens = np.random.default_rng(0).integers(0, 64, size=(2, 16))

  def loss_and_grads(c):
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Llama(c, rngs=nnx.Rngs(0))))
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(tokens, np.arange(16)) ** 2)
    return jax.jit(jax.value_and_grad(loss))(params)

  import jax.numpy as jnp
  want = loss_and_grads(dataclasses.replace(cfg, scan_layers=False))
  for variant in (cfg, dataclasses.replace(cfg, remat_policy="full")):
    got = loss_and_grads(variant)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_import_export_is_bitwise(tmp_path, gemmas, family):
  """load_hf_params (8-device mesh) -> write_hf_dir: every tensor (the four norms, q/k
  norms) bitwise equal, config.json the same architecture with the same windows, caps,
  scale and RoPE as transformers reads them, and it imports back to the same config."""
  from test_export_hf import _assert_bitwise_equal, _tensors

  _, path = gemmas[family]
  cfg = convert_hf.load_hf_config(path)
  params = convert_hf.load_hf_params(path, cfg, mesh=mesh_lib.make_mesh(MESH))
  out = str(tmp_path / "export")
  export_hf.write_hf_dir(params, cfg, out, hf_dir=path)
  _assert_bitwise_equal(_tensors(out), _tensors(path))
  assert convert_hf.load_hf_config(out) == cfg
  original = transformers.AutoConfig.from_pretrained(path)
  exported = transformers.AutoConfig.from_pretrained(out)
  assert type(exported) is type(original) and exported.architectures == original.architectures
  for key in ("sliding_window", "layer_types", "tie_word_embeddings", "head_dim",
              "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
              "hidden_activation", "rms_norm_eps", "rope_parameters", "max_position_embeddings"):
    assert getattr(exported, key, None) == getattr(original, key, None), key


def test_gemma_export_refuses_what_it_cannot_write():
  """Export refuses a config its family cannot express, naming the family that could."""
  gemma2 = dict(family="gemma2", mlp_activation="gelu_tanh", norm_unit_offset=True,
                post_norms=True, scale_embeddings=True)
  with pytest.raises(ValueError, match="gemma2 and gemma3 have the Gemma block"):
    convert_hf.hf_config_dict(LlamaConfig(**dict(gemma2, post_norms=False)))
  with pytest.raises(ValueError, match="gemma2 has one"):
    convert_hf.hf_config_dict(LlamaConfig(attn_logits_soft_cap=30.0))
  with pytest.raises(ValueError, match="gemma3 has one"):
    convert_hf.hf_config_dict(LlamaConfig(**dict(gemma2, rope_local_theta=1e4)))
  with pytest.raises(ValueError, match="gemma3 has one"):
    convert_hf.hf_config_dict(LlamaConfig(**dict(gemma2, family="gemma3", qk_norm=True)))
  with pytest.raises(ValueError, match="no family this exports to has them"):
    convert_hf.hf_config_dict(LlamaConfig(attn_sinks=True))


@pytest.mark.parametrize("change,match", [
    (dict(model_type="gemma3"), "multimodal Gemma 3"),
    (dict(hidden_activation="gelu"), "hidden_activation 'gelu'"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0}}),
     "sliding layers' rope_type 'linear'"),
])
def test_unsupported_gemma_config_is_one_error_naming_it(gemmas, tmp_path, change, match):
  hf = convert_hf.read_hf_config_json(gemmas["gemma3"][1])
  hf.update(change)
  (tmp_path / "config.json").write_text(json.dumps(hf))
  with pytest.raises(ValueError, match=match):
    convert_hf.hf_model_fields(str(tmp_path))


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_finetune_export_generate(tmp_path, family):
  """make_tiny_hf.py --family gemma2|gemma3 -> train.py (configs/finetune.py: ring attention
  on data=2 x sequence=4, the 32-token windows pruning hops over 16-token shards) ->
  export_hf.py: transformers loads the export as the same architecture with logits equal
  to ours from the trained checkpoint (rtol 1e-4), and generate.py's greedy continuation
  (KV-cache decoding with the soft-caps, scale and windows) equals transformers' greedy
  generate on it."""
  pytest.importorskip("tokenizers")
  import generate
  import train as train_script
  from configs import finetune
  from models import sharding as shd
  from scripts import make_tiny_hf
  from test_export_hf import _tensors
  from training import flags as flags_lib
  from training import hf_init as hf_init_lib
  from training import validation as val_lib

  source, corpus = str(tmp_path / family), str(tmp_path / "corpus.jsonl")
  texts = make_tiny_hf.corpus_texts(60)
  make_tiny_hf.write_corpus(corpus, texts)
  make_tiny_hf.write_tokenizer(source, texts, 264)
  make_tiny_hf.write_model(source, vocab_size=264, family=family)
  config = flags_lib.apply_overrides(finetune.get_config(), {
      "init.hf_dir": source, "data.path": corpus, "data.seq_len": 64, "batch_size": 4,
      "eval_batch_size": 4, "eval_batches": 1, "total_steps": 2, "optim.warmup_steps": 1,
      "optim.lr": 1e-2, "log_every": 1, "async_checkpointing": False}.items())
  workdir, out = str(tmp_path / "run"), str(tmp_path / "export")
  config = val_lib.resolve_run(hf_init_lib.resolve_hf_init(config), jax.device_count())
  os.makedirs(workdir)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  train_script.train(config, workdir)
  export_hf.export(workdir, out, log=lambda _: None)

  architecture = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}[family]
  exported = json.loads(open(os.path.join(out, "config.json")).read())
  assert exported["architectures"] == [architecture]
  run_config = export_hf.read_run_config(workdir)
  model_cfg = val_lib.llama_config(run_config)
  assert model_cfg.attention == "ring" and model_cfg.family == family
  assert model_cfg.layer_windows == (32, None)
  step, params = export_hf.restore_params(workdir, model_cfg, None)
  name = "model.layers.0.post_feedforward_layernorm.weight"
  assert not np.array_equal(_tensors(out)[name], _tensors(source)[name])  # it trained
  mesh = mesh_lib.make_mesh(MESH)
  tokens_BL = np.random.default_rng(3).integers(0, model_cfg.vocab_size, size=(2, 64))
  ours = _ring_logits(shd.shard_params(params, mesh),
                      dataclasses.replace(model_cfg, layout="zigzag"), mesh, tokens_BL)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(reloaded).__name__ == architecture
  with torch.no_grad():
    theirs = reloaded(torch.tensor(tokens_BL, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)

  # A prompt longer than the window, so decoding reads a windowed cache.
  prompt = [int(t) for t in np.random.default_rng(4).integers(3, 264, size=40)]
  texts_out = generate.run(run_config, workdir=workdir, prompts=[" ".join(map(str, prompt))],
                           max_new_tokens=12, temperature=0.0, top_p=1.0, seed=0,
                           tokenizer="ids", out=io.StringIO(), log=lambda _: None)
  assert [int(t) for t in texts_out[0].split()] == _hf_greedy(reloaded, prompt, 12)


@pytest.mark.parametrize("fields,match", [
    (dict(mlp_activation="relu"), "mlp_activation must be one of"),
    (dict(query_pre_attn_scalar=0.0), "query_pre_attn_scalar must be None or a finite"),
    (dict(rope_local_theta=float("inf")), "rope_local_theta must be None or a finite"),
    (dict(attn_logits_soft_cap=-1.0), "attn_logits_soft_cap must be None"),
    (dict(final_logits_soft_cap=float("nan")), "final_logits_soft_cap must be None"),
])
def test_bad_gemma_fields_are_one_error(fields, match):
  with pytest.raises(ValueError, match=match):
    LlamaConfig(**fields)


def test_sinks_run_with_every_attention_backend_and_auto_plans_them_all():
  """attn_sinks is a field of the model whatever its attention (every strategy applies the
  sinks, tests/ring_jax/test_sinks_strategies.py), and "auto" plans among every candidate
  with them as without them."""
  from models import attention as attn_lib

  for name in attn_lib.ATTENTION_BACKENDS:
    assert LlamaConfig(attn_sinks=True, attention=name).attention == name
  mesh = mesh_lib.make_mesh(dict(data=2, sequence=4, tensor=1))
  plans = [attn_lib.plan_attention(LlamaConfig(attn_sinks=sinks, attention="auto"), mesh,
                                   batch=2, seq_len=4096) for sinks in (True, False)]
  assert [{e.strategy for e in p.estimates} for p in plans] == [set(attn_lib.AUTO_CANDIDATES)] * 2
  assert plans[0].strategy == plans[1].strategy


def test_run_saved_before_the_gemma_fields_exports(tmp_path):
  """A train.py run whose saved config.json predates the Gemma fields (and whose
  init.hf_dir is gone) still reads: the missing fields take LlamaConfig's defaults
  instead of sending export_hf.py back to the source directory."""
  from configs import tiny
  from training import validation as val_lib

  config = tiny.get_config()
  saved = config.to_dict()
  saved["init"]["hf_dir"] = str(tmp_path / "gone")
  saved["model"]["layout"] = "zigzag"
  for name in ("mlp_activation", "norm_unit_offset", "post_norms", "scale_embeddings",
               "query_pre_attn_scalar", "attn_logits_soft_cap", "final_logits_soft_cap",
               "rope_local_theta", "attn_sinks"):
    saved["model"].pop(name, None)
  (tmp_path / "config.json").write_text(json.dumps(saved))
  model_cfg = val_lib.llama_config(export_hf.read_run_config(str(tmp_path)))
  assert (model_cfg.mlp_activation, model_cfg.post_norms, model_cfg.family) == (
      "silu", False, "llama")
