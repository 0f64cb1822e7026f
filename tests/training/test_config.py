"""Config files, gin overrides onto the ConfigDict, mesh resolution and up-front errors."""

import importlib.util
import os
import sys

import jax
import ml_collections
import pytest

from model_utils import tiny_config
from training.errors import ConfigError
from training import flags as flags_lib
from training import mesh as mesh_lib
from training import validation as val_lib

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def load_config(name: str, arg=None) -> ml_collections.ConfigDict:
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "configs", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg)


def tiny(**overrides) -> ml_collections.ConfigDict:
  return tiny_config(**overrides)


# --- shipped configs -------------------------------------------------------------------------


@pytest.mark.parametrize("name,arg", [("tiny", None), ("tiny", "text,micro"),
                                      ("tiny", "dense,striped"), ("llama_1b", None),
                                      ("llama_7b", None)])
def test_shipped_configs_build_a_model_config(name, arg):
  config, _ = val_lib.resolve_layout(load_config(name, arg), ring_size=8)
  model_cfg = val_lib.llama_config(config)
  assert model_cfg.num_params() > 0
  assert model_cfg.flops_per_token(config.data.seq_len) > 6 * model_cfg.num_params(False)


@pytest.mark.parametrize("name,arg", [("tiny", None), ("llama_1b", "long"), ("llama_7b", None),
                                      ("finetune", None)])
def test_config_model_has_llama_configs_fields(name, arg):
  """config.model is models.llama.LlamaConfig's schema, read from the class (a field added
  there is in every config); tiny keeps its defaults but for the tiny sizes and "auto"."""
  from models.llama import LlamaConfig

  model = load_config(name, arg).model
  defaults = LlamaConfig().to_dict()
  assert set(model) == set(defaults)
  if name == "tiny":
    assert {n for n in defaults if model[n] != defaults[n]} == {
        "vocab_size", "dim", "mlp_dim", "layout"}


def test_command_line_and_gin_set_model_fields_with_their_types(monkeypatch):
  """--config.model.<field>=<text> and gin bindings parse to the LlamaConfig field's type,
  for fields whose default is None too (the ConfigDict holds a typed placeholder)."""
  from absl import flags
  from ml_collections import config_flags

  argv = ["train.py", f"--config={os.path.join(ROOT, 'configs', 'tiny.py')}",
          "--config.model.sliding_window=8", "--config.model.head_dim=16",
          "--config.model.qkv_bias=True", "--config.model.rope_theta=5e5",
          "--config.model.family=qwen2", "--config.model.causal_routing=False"]
  monkeypatch.setattr(sys, "argv", argv)  # config_flags finds the overrides in sys.argv
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=values)
  values(argv)
  model = values.config.model
  assert (model.sliding_window, model.head_dim, model.qkv_bias, model.rope_theta,
          model.family, model.causal_routing) == (8, 16, True, 5e5, "qwen2", False)
  assert type(model.sliding_window) is int and type(model.rope_theta) is float
  config = flags_lib.apply_gin(tiny(), gin_params=[
      "model.sliding_window = 4", "model.qk_norm = True", "model.block_q = 32"])
  assert (config.model.sliding_window, config.model.qk_norm, config.model.block_q) == (
      4, True, 32)
  with pytest.raises(ConfigError):
    flags_lib.apply_gin(tiny(), gin_params=["model.sliding_window = 'eight'"])


def test_tiny_validates_on_eight_devices():
  assert val_lib.validate_config(tiny(), num_devices=8) == dict(
      data=2, pipeline=1, sequence_outer=1, sequence=4, tensor=1)


@pytest.mark.parametrize("name,devices,expected", [
    ("llama_1b", 256, dict(data=16, pipeline=1, sequence_outer=1, sequence=16, tensor=1)),
    ("llama_7b", 512, dict(data=8, pipeline=1, sequence_outer=1, sequence=16, tensor=4)),
])
def test_long_context_configs_fill_the_mesh(name, devices, expected):
  config = load_config(name)
  assert val_lib.validate_config(config, num_devices=devices) == expected


def test_unknown_variant_raises():
  with pytest.raises(ValueError, match="unknown tiny.py variants"):
    load_config("tiny", "nope")


def test_finetune_yarn_variant():
  """configs/finetune.py:yarn:<factor>:<original>: YaRN in place of the checkpoint's RoPE
  scaling (the README's Hugging Face block), anything else a clear error."""
  assert load_config("finetune").model.rope_scaling is None  # None: config.json's
  assert dict(load_config("finetune", "yarn:4:32768").model.rope_scaling) == dict(
      rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)
  for bad in ("yarn", "yarn:4", "yarn:x:64", "linear:4:64"):
    with pytest.raises(ValueError, match="yarn:<factor>:<original_max_position_embeddings>"):
      load_config("finetune", bad)


# --- gin syntax -> the same ConfigDict ------------------------------------------------------


def test_gin_params_and_files_override_config_fields(tmp_path):
  config = tiny()
  gin_file = tmp_path / "over.gin"
  gin_file.write_text("model.num_layers = 4\noptim.lr = 1e-4\ninclude 'more.gin'\n")
  (tmp_path / "more.gin").write_text("data.kv.num_pairs = 5\nconfig.total_steps = 9\n")
  flags_lib.apply_gin(config, [str(gin_file)], ["model.layout = 'striped'",
                                                "model.num_layers = 3"])
  assert config.model.num_layers == 3  # --gin_param comes after --gin_file
  assert config.optim.lr == 1e-4 and config.data.kv.num_pairs == 5
  assert config.total_steps == 9 and config.model.layout == "striped"


def test_gin_rejects_unknown_fields_wrong_types_and_references():
  with pytest.raises(ConfigError, match="no field 'model.num_layerz'"):
    flags_lib.apply_gin(tiny(), gin_params=["model.num_layerz = 4"])
  with pytest.raises(ConfigError, match="no field 'modle'"):
    flags_lib.apply_gin(tiny(), gin_params=["modle.num_layers = 4"])
  with pytest.raises(ConfigError, match="num_layers"):
    flags_lib.apply_gin(tiny(), gin_params=["model.num_layers = 'four'"])
  with pytest.raises(ConfigError, match="reference"):
    flags_lib.apply_gin(tiny(), gin_params=["model.num_layers = @foo"])
  with pytest.raises(ConfigError, match="does not exist"):
    flags_lib.apply_gin(tiny(), gin_files=["/nonexistent.gin"])


# --- mesh ------------------------------------------------------------------------------------


def test_mesh_fill_axis_and_make_mesh():
  assert mesh_lib.mesh_shape(ml_collections.ConfigDict(dict(data=-1, sequence=4, tensor=1)),
                             8) == dict(data=2, pipeline=1, sequence_outer=1, sequence=4,
                                        tensor=1)
  mesh = mesh_lib.make_mesh(ml_collections.ConfigDict(dict(data=1, sequence=-1, tensor=1)))
  assert dict(mesh.shape) == dict(data=1, pipeline=1, sequence_outer=1, sequence=8, tensor=1)
  one = mesh_lib.make_mesh(ml_collections.ConfigDict(dict(data=1, sequence=1, tensor=1)),
                           devices=jax.devices()[:1])
  assert one.size == 1


@pytest.mark.parametrize("mesh,match", [
    (dict(data=2, sequence=2, tensor=1), "needs 4 devices but 8"),
    (dict(data=-1, sequence=-1, tensor=1), "at most one axis may be -1"),
    (dict(data=-1, sequence=3, tensor=1), "does not divide"),
    (dict(data=2, sequence=4, expert=1), "unknown axes"),
])
def test_mesh_errors(mesh, match):
  with pytest.raises(ConfigError, match=match):
    val_lib.validate_config(tiny(**{f"mesh.{k}": v for k, v in mesh.items()
                                    if k in mesh_lib.MESH_AXES}) if "expert"
                            not in mesh else _with_mesh(mesh), num_devices=8)


def _with_mesh(mesh):
  config = tiny()
  config.unlock()
  config.mesh = ml_collections.ConfigDict(mesh)
  return config


# --- everything else that must fail before compiling ---------------------------------------


@pytest.mark.parametrize("overrides,match", [
    ({"model.attention": "flash"},
     r"config.model: attention must be one of \[.*'ring'.*got 'flash'"),
    ({"model.layout": "spiral"}, r"model.layout='spiral' is unknown; choose one of \('auto', "),
    ({"model.hop_kernel": "flash"},
     r"config.model: hop_kernel='flash' is not a known hop kernel; choose one of.*'auto', 'xla'"),
    ({"mesh.data": 1, "mesh.sequence": 2, "mesh.tensor": 4, "model.num_heads": 6,
      "model.num_kv_heads": 2}, "num_heads=6 is not divisible by the mesh 'tensor'"),
    ({"mesh.data": 1, "mesh.sequence": 2, "mesh.tensor": 4, "model.num_kv_heads": 2},
     "num_kv_heads=2 is not divisible by the mesh 'tensor'"),
    ({"model.num_heads": 4, "model.num_kv_heads": 3},
     "config.model: num_heads=4 must be a multiple of num_kv_heads=3"),
    ({"batch_size": 5}, "not divisible by the mesh 'data' axis"),
    ({"batch_size": 16, "microbatches": 3}, "not divisible by microbatches=3"),
    ({"batch_size": 16, "microbatches": 16}, "rows per microbatch is not divisible"),
    ({"eval_batch_size": 3}, "eval_batch_size=3"),
    ({"data.kind": "text"}, "needs data.path"),
    ({"data.kind": "text", "data.path": "/nonexistent/corpus"}, "matches no"),
    ({"data.kind": "webdataset"}, "data.kind='webdataset' is unknown"),
    ({"model.vocab_size": 64}, "needs model.vocab_size >= 67"),
    # The data module's own ValueError, wrapped by validate_config.
    ({"data.kv.num_queries": 9}, "num_queries=9 exceeds num_pairs=8"),
    ({"data.kv.docs_per_row": 0}, "docs_per_row=0"),
    ({"data.seq_len": 0}, "data.seq_len"),
    ({"optim.warmup_steps": 10_000}, "warmup_steps"),
    # Two-level mesh (sequence_outer x sequence): one ring of 8, strategies that run on a pair.
    ({"mesh.data": 1, "mesh.sequence_outer": 2, "model.attention": "ulysses"},
     r"model\.attention='ulysses' runs over one sequence axis.*use model\.attention='ring'.*"
     r"or mesh\.sequence_outer=1"),
    ({"mesh.data": 1, "mesh.sequence_outer": 2, "model.attention": "hybrid"},
     r"model\.attention='hybrid' runs over one sequence axis"),
])
def test_bad_configs_fail_with_a_clear_message(overrides, match):
  with pytest.raises(ConfigError, match=match):
    val_lib.validate_config(tiny(**overrides), num_devices=8)


def test_one_list_of_mesh_axes():
  """The trainer validates against the model's table of mesh axes (not a copy of it)."""
  from models import sharding as shd

  assert mesh_lib.MESH_AXES is shd.MESH_AXES
  mesh = mesh_lib.make_mesh(ml_collections.ConfigDict(dict(data=2, sequence=4, tensor=1)))
  assert mesh.axis_names == shd.MESH_AXES


@pytest.mark.parametrize("attention", ["ring", "all_gather", "auto", "dense"])
def test_two_level_mesh_validates(attention):
  """mesh.sequence_outer=2 x sequence=4: the ring (two-level), all_gather and auto run on the
  pair; the model's sequence axis is the pair, the layouts span the ring of 8."""
  from models import attention as attn_lib

  config = tiny(**{"mesh.data": 1, "mesh.sequence_outer": 2, "model.attention": attention})
  sizes = val_lib.validate_config(config, num_devices=8)
  assert sizes == dict(data=1, pipeline=1, sequence_outer=2, sequence=4, tensor=1)
  mesh = mesh_lib.make_mesh(config.mesh)
  assert attn_lib.sequence_axis(mesh) == ("sequence_outer", "sequence")
  resolved, _ = val_lib.resolve_attention(config, mesh)
  # "auto": ring_jax.plan over the pair (2, 4), among the strategies that run on it.
  assert resolved.attention in (("ring", "all_gather") if attention == "auto" else (attention,))
  # Any length: zigzag over 8 splits multiples of 16, 264 runs padded to 272.
  odd = tiny(**{"mesh.data": 1, "mesh.sequence_outer": 2, "model.attention": attention,
                "data.seq_len": 264})
  val_lib.validate_config(odd, 8)
  assert val_lib.run_length(odd.model, 8, 264) == 272


def test_registered_attention_backend_is_a_valid_config(monkeypatch):
  from models import attention as attn_lib

  monkeypatch.setitem(attn_lib.ATTENTION_BACKENDS, "mine", attn_lib.dense)
  config = tiny(**{"model.attention": "mine"})
  assert val_lib.validate_config(config, num_devices=8)["sequence"] == 4
  assert val_lib.llama_config(config).attention == "mine"


def test_single_kv_head_is_replicated_not_an_error():
  config = tiny(**{"mesh.data": 1, "mesh.sequence": 4, "mesh.tensor": 2,
                   "model.num_kv_heads": 1})
  assert val_lib.validate_config(config, num_devices=8)["tensor"] == 2


def test_text_needs_byte_vocab(tmp_path):
  (tmp_path / "a.txt").write_text("hello")
  config = tiny(**{"data.kind": "text", "data.path": str(tmp_path), "model.vocab_size": 200})
  with pytest.raises(ConfigError, match="byte tokenizer needs model.vocab_size >= 259"):
    val_lib.validate_config(config, num_devices=8)
  config.model.vocab_size = 264
  val_lib.validate_config(config, num_devices=8)


def test_train_rejects_bad_config_before_compiling(tmp_path, monkeypatch):
  import train as train_script
  from training import step as step_lib

  def must_not_compile(*_):
    raise AssertionError("compiled despite a bad config")

  monkeypatch.setattr(step_lib.TrainStep, "jit", must_not_compile)
  with pytest.raises(ConfigError, match="needs 6 devices"):
    train_script.train(tiny(**{"mesh.data": 3, "mesh.sequence": 2}), str(tmp_path))
  assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))


@pytest.mark.parametrize("overrides,message", [
    ({"optim.lr": -1e-3}, "optim.lr=-0.001 must be > 0."),
    ({"optim.lr": float("nan")}, "optim.lr=nan must be a finite number > 0."),
    ({"optim.warmup_steps": -1}, "optim.warmup_steps=-1 must be a whole number >= 0."),
    ({"optim.b1": 1.0}, "optim.b1=1.0 must be in [0, 1)."),
    ({"optim.b2": -0.5}, "optim.b2=-0.5 must be in [0, 1)."),
    ({"optim.eps": 0.0}, "optim.eps=0.0 must be > 0."),
    ({"optim.grad_clip": -1.0}, "optim.grad_clip=-1.0 must be > 0."),
    ({"optim.weight_decay": -0.1}, "optim.weight_decay=-0.1 must be >= 0."),
    ({"optim.min_lr_ratio": 1.5}, "optim.min_lr_ratio=1.5 must be in [0, 1]."),
    ({"model.norm_eps": 0.0}, "model.norm_eps=0.0 must be > 0."),
    ({"model.rope_theta": float("inf")}, "model.rope_theta=inf must be a finite number > 0."),
    ({"model.rope_scaling": {"rope_type": "linear", "factor": -4.0}},
     "model.rope_scaling.factor=-4.0 must be > 0."),
    ({"model.rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                             "original_max_position_embeddings": 0}},
     "model.rope_scaling.original_max_position_embeddings=0 must be a whole number >= 1."),
    ({"data.eval_fraction": 1.0}, "data.eval_fraction=1.0 must be in (0, 1)."),
    ({"batch_size": 0}, "batch_size=0 must be a whole number >= 1."),
    ({"keep_checkpoints": 0}, "keep_checkpoints=0 must be a whole number >= 1."),
    ({"total_steps": 0}, "total_steps=0 must be a whole number >= 1."),
    ({"cpu_peak_flops_per_device": -1.0}, "cpu_peak_flops_per_device=-1.0 must be > 0."),
])
def test_numeric_fields_out_of_range_fail_first_with_one_line(overrides, message):
  """Every numeric field with a valid range is checked before anything else (before the mesh,
  the data or the model): one line naming the field, its value and the range."""
  with pytest.raises(ConfigError) as e:
    val_lib.validate_config(tiny(**overrides), num_devices=3)  # a mesh that does not fit
  assert str(e.value) == message


def test_numeric_ranges_hold_for_the_shipped_configs_and_name_real_fields():
  for name, arg in (("tiny", None), ("tiny", "text,micro"), ("llama_1b", None),
                    ("llama_7b", None), ("finetune", "yarn:4:64")):
    val_lib.check_ranges(load_config(name, arg))
  config = tiny()
  for path in val_lib.NUMERIC_RANGES:
    parent, _, leaf = path.rpartition(".")
    node = config
    for part in filter(None, parent.split(".")):
      node = node[part]
    if parent != "model.rope_scaling":
      assert leaf in node, path  # not a typo the check would skip forever


def test_a_negative_learning_rate_stops_train_before_compiling(tmp_path, monkeypatch):
  import train as train_script
  from training import step as step_lib

  def must_not_compile(*_):
    raise AssertionError("compiled despite a bad config")

  monkeypatch.setattr(step_lib.TrainStep, "jit", must_not_compile)
  with pytest.raises(ConfigError, match=r"^optim\.lr=-0\.003 must be > 0\.$"):
    train_script.train(tiny(**{"optim.lr": -3e-3}), str(tmp_path))
  assert os.listdir(tmp_path) == []


def test_a_run_shorter_than_its_warmup_warms_up_over_all_its_steps(tmp_path, monkeypatch,
                                                                    capsys):
  """--config.total_steps=2 is a smoke run on its own: the default warmup (40) is clamped to
  the run, in a startup line; a stage's own warmup longer than the stage stays an error."""
  import train as train_script
  from training import stages as stages_lib

  seen, resolve = {}, train_script._config_and_mesh

  class Resolved(Exception):
    pass

  def resolve_then_stop(config):  # the config the loop gets, and nothing compiled
    seen["c"] = resolve(config)[0]
    raise Resolved

  monkeypatch.setattr(train_script, "_config_and_mesh", resolve_then_stop)
  with pytest.raises(Resolved):
    train_script.train(tiny(total_steps=2), str(tmp_path))
  assert seen["c"].optim.warmup_steps == 2 and seen["c"].total_steps == 2
  assert ("optim.warmup_steps=40 exceeds total_steps=2: warming up over all 2 steps "
          "(optim.warmup_steps=2)") in capsys.readouterr().out.splitlines()
  config = tiny(total_steps=40)
  assert val_lib.clamp_warmup(config) == (config, None)  # fits: unchanged
  staged = stages_lib.resolve(tiny(stages="64:2,128:2"))
  assert val_lib.clamp_warmup(staged) == (staged, None)
  with pytest.raises(ConfigError, match="warmup_steps=40 exceeds the stage's steps=2"):
    val_lib.validate_config(staged, num_devices=8)


@pytest.mark.parametrize("text,want", [(None, None), ("", None), ("10:13", range(10, 13)),
                                       ("1:2", range(1, 2))])
def test_profile_steps(text, want):
  """--config.profile_steps=START:STOP profiles steps START..STOP-1; unset or empty: off."""
  assert val_lib.profile_steps(tiny(**{"profile_steps": text})) == want


@pytest.mark.parametrize("text,match", [
    ("10", "must be 'START:STOP'"), ("a:b", "must be 'START:STOP'"),
    ("5:5", "1 <= START < STOP"), ("0:3", "1 <= START < STOP"),
    ("700:710", "starts after total_steps=600"),
])
def test_bad_profile_steps_is_a_config_error(text, match):
  with pytest.raises(ConfigError, match=match):
    val_lib.validate_config(tiny(**{"profile_steps": text}), num_devices=8)


# --- model.layout="auto" -----------------------------------------------------------------------


@pytest.mark.parametrize("overrides, ring, want, why", [
    ({}, 4, "document", "data.kv.docs_per_row=2"),  # the kv task packs two documents
    ({"data.kind": "text"}, 4, "document", "data.kind='text' packs documents"),
    ({"data.kv.docs_per_row": 1}, 4, "zigzag", "one sequence per row"),
    ({}, 1, "contiguous", "a ring of 1 device"),
])
def test_resolve_layout_picks_by_the_data_and_the_ring(overrides, ring, want, why):
  """model.layout="auto" -> (a copy naming the layout, the startup line saying why); the
  rule itself is ring_jax.planning.choose_layout (tests/ring_jax/test_plan.py: each branch)."""
  config = tiny(**{"model.layout": "auto", **overrides})
  resolved, line = val_lib.resolve_layout(config, ring)
  assert resolved.model.layout == want and config.model.layout == "auto"
  assert line.startswith(f"layout: auto -> {want} (") and why in line, line
  assert val_lib.resolve_layout(resolved, ring) == (resolved, None)  # idempotent
  assert val_lib.llama_config(resolved).layout == want


def test_named_layouts_stay_and_auto_is_no_model_layout():
  """A named layout is kept as it is; llama_config refuses "auto" (it needs the ring and
  the data: resolve_layout), naming the fix."""
  config = tiny(**{"model.layout": "striped"})
  assert val_lib.resolve_layout(config, 4) == (config, None)
  with pytest.raises(ConfigError, match="resolve_layout"):
    val_lib.llama_config(tiny(**{"model.layout": "auto"}))


def test_auto_layout_validates_as_it_resolves_and_every_stage_runs_it():
  """validate_config checks "auto" as the layout it resolves to on the mesh's ring (the
  length rule of "document" here, of "contiguous" on a ring of 1), and config.stages,
  which change seq_len, batch and RoPE but not the data, all run the resolved layout."""
  from training import stages as stages_lib

  auto = tiny(**{"model.layout": "auto", "data.seq_len": 132})
  val_lib.validate_config(auto, 8)  # any length runs: padded to document's multiple of 8
  assert val_lib.run_length(val_lib.resolve_layout(auto, 4)[0].model, 4, 132) == 136
  one = tiny(**{"model.layout": "auto", "data.seq_len": 129, "mesh.data": 8,
                "mesh.sequence": 1, "data.kv.docs_per_row": 1})
  assert val_lib.validate_config(one, 8)["sequence"] == 1  # contiguous: any length
  staged = stages_lib.resolve(tiny(**{"model.layout": "auto", "optim.warmup_steps": 0,
                                      "stages": "128:2,256:2:rope_theta=1e5"}))
  assert val_lib.validate_config(staged, 8)["sequence"] == 4
  resolved, line = val_lib.resolve_layout(staged, 4)
  assert "-> document" in line
  assert [s.config.model.layout for s in stages_lib.plan(resolved)] == ["document"] * 2


@pytest.mark.parametrize("name, arg, devices, want", [
    ("tiny", None, 8, "document"),
    ("llama_1b", None, 256, "document"),
    ("llama_1b", "long", 8, "document"),  # one 512K row of the kv task: two documents
    ("llama_7b", "4d", 256, "document"),
    ("finetune", None, 8, "document"),  # text
])
def test_shipped_configs_resolve_auto(name, arg, devices, want):
  """Every shipped config leaves model.layout to "auto"; on its mesh it resolves to the
  document layout (each trains on packed rows), and the :long variant with one document
  per row resolves to zigzag by itself."""
  config = load_config(name, arg)
  assert config.model.layout == "auto"
  assert val_lib.resolve_run(config, devices).model.layout == want
  if arg == "long":
    config.data.kv.docs_per_row = 1
    assert val_lib.resolve_run(config, devices).model.layout == "zigzag"


def _tiny_hf_dir(tmp_path_factory, family: str) -> str:
  """scripts/make_tiny_hf.py's model of ``family`` (qwen2: a 64-token window on its second
  layer, mistral: on every layer; llama and qwen3: none), saved once per test session."""
  from scripts import make_tiny_hf

  path = str(tmp_path_factory.getbasetemp() / f"tiny_hf_{family}")
  if not os.path.isdir(path):
    make_tiny_hf.write_model(path, vocab_size=320, num_layers=2, family=family)
  return path


@pytest.mark.parametrize("family, window", [("llama", None), ("qwen2", 64), ("qwen3", None),
                                            ("mistral", 64)])
@pytest.mark.parametrize("how", ["hf_dir", "init.hf_dir"])
@pytest.mark.parametrize("ring, seq_len", [(4, 256), (4, 64), (1, 256)])  # 64: zigzag
def test_resolve_config_gives_a_layout_the_family_runs(tmp_path_factory, family, window, how,
                                                       ring, seq_len):
  """resolve_config, the one resolver of train/generate/evaluate/fit: with a model from a
  script's --hf_dir or from init.hf_dir (configs/finetune.py), "auto" is decided for that
  model's windows: packed rows get "document" without a window, and with one the layout
  planning.choose_layout gives (contiguous when the window skips hops, else zigzag), which
  the model and the ring's attention check accept on every layer."""
  from models.llama import LlamaConfig
  from ring_jax import layouts, planning

  path = _tiny_hf_dir(tmp_path_factory, family)
  if how == "hf_dir":  # --config configs/tiny.py:text --hf_dir DIR (the tiny model's fields)
    config = tiny(**{"model.layout": "auto", "data.kind": "text", "data.seq_len": seq_len})
    resolved, line = val_lib.resolve_config(config, ring, hf_dir=path)
  else:
    config = flags_lib.apply_overrides(load_config("finetune"), {
        "init.hf_dir": path, "data.seq_len": seq_len}.items())
    resolved, line = val_lib.resolve_config(config, ring)
  assert resolved.model.sliding_window == window and resolved.model.family == family
  if window is None:
    want = "contiguous" if ring == 1 else "document"
  else:
    want = planning.choose_layout(ring, packed=True, local_window_size=(window - 1, 0),
                                  local_len=seq_len // ring)[0]
    assert want != "document"
  assert resolved.model.layout == want and f"auto -> {want}" in line
  assert val_lib.resolve_config(resolved, ring, hf_dir=path if how == "hf_dir" else None) == (
      resolved, None)  # idempotent
  fields = {n: resolved.model[n] for n in LlamaConfig.__dataclass_fields__ if n in resolved.model}
  model_cfg = LlamaConfig.from_dict(fields)
  for layer_window in model_cfg.layer_windows:  # what the ring's attention checks at trace time
    layouts.check_attention_layout(
        model_cfg.layout, segment_ids=object(),
        local_window_size=None if layer_window is None else (layer_window - 1, 0))


def test_document_layout_with_a_window_is_refused_up_front():
  """A layout the model cannot run is a one-line error when the model config is built, not
  a trace-time failure deep in the ring."""
  from models.llama import LlamaConfig

  with pytest.raises(ValueError, match=r"layout='document'.*sliding_window=8.*'zigzag'"):
    LlamaConfig(layout="document", sliding_window=8)
  with pytest.raises(ValueError, match=r"layout='document'.*sliding_window=8"):
    LlamaConfig(layout="document", sliding_window=8, num_layers=2,
                layer_types=("full_attention", "sliding_attention"))
  assert LlamaConfig(layout="document", sliding_window=8, num_layers=2,  # no layer windowed
                     layer_types=("full_attention", "full_attention")).layout == "document"
