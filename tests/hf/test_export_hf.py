"""init.hf_dir -> train.py -> export_hf.py: config resolution, bitwise round trips, and the
exported directory loading in transformers with logits equal to ours."""

import dataclasses
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

import export_hf
from configs import common, finetune, tiny
from model_utils import random_params
from models import convert_hf
from models import sharding as shd
from models.llama import LlamaConfig
from training import errors
from training import hf_init as hf_init_lib
from training import mesh as mesh_lib
from training import validation as val_lib
import train_procs

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MESH = dict(data=2, sequence=4, tensor=1)
TINY = dict(vocab_size=256, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
            mlp_dim=128)  # head_dim explicit: config.json states it


def _tensors(path: str) -> dict[str, np.ndarray]:
  """Every tensor of an HF directory, read whole."""
  ckpt = convert_hf.HFCheckpoint(path)
  return {name: ckpt.read(name) for name in ckpt.names()}


def _assert_bitwise_equal(got: dict, want: dict):
  assert sorted(got) == sorted(want)
  for name in want:
    assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
    assert got[name].tobytes() == want[name].tobytes(), name


def _ours_dir(tmp_path, cfg: LlamaConfig, max_shard_bytes=10**9, seed=0) -> str:
  """A HF directory written from random params of ``cfg`` (no torch needed)."""
  params = random_params(cfg, seed=seed)
  if cfg.param_dtype != "float32":
    params = jax.tree.map(lambda x: x.astype(cfg.weight_dtype), params)
  out = str(tmp_path / "ours")
  export_hf.write_hf_dir(params, cfg, out, max_shard_bytes=max_shard_bytes)
  return out


# ----------------------------------------------------------------------------------------------
# Without torch: config resolution and our own round trip
# ----------------------------------------------------------------------------------------------


def test_finetune_config_has_every_common_field():
  base, ft = common.base_config(), finetune.get_config()
  flat = lambda c: set(c.to_dict()) | {f"{k}.{j}" for k, v in c.to_dict().items()
                                       if isinstance(v, dict) for j in v}
  assert flat(base) <= flat(ft)
  assert ft.init.hf_dir == "" and tiny.get_config().init.hf_dir == ""
  # The fields config.json determines are left None; the others are common.py's.
  assert all(ft.model[name] is None for name in convert_hf.HF_FIELDS)
  assert {n: v for n, v in ft.model.items() if n not in convert_hf.HF_FIELDS} == {
      n: v for n, v in base.model.items() if n not in convert_hf.HF_FIELDS}


def test_resolve_hf_init(tmp_path):
  cfg = LlamaConfig(**TINY, rope_theta=500.0, tie_embeddings=True,
                    rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=16))
  path = _ours_dir(tmp_path, cfg)
  config = finetune.get_config()
  config.init.hf_dir = path
  config.model.rope_theta = 1e6  # set by the user: an override
  logs = []
  resolved = hf_init_lib.resolve_hf_init(config, log=logs.append)
  assert config.model.dim is None  # a copy: the input is untouched
  model_cfg = val_lib.llama_config(val_lib.resolve_layout(resolved, ring_size=4)[0])
  for name in convert_hf.HF_SHAPE_FIELDS + ("rope_scaling", "norm_eps"):
    assert getattr(model_cfg, name) == getattr(cfg, name), name
  assert model_cfg.rope_theta == 1e6
  assert logs == [f"model.rope_theta=1000000.0 overrides 500.0 of {path}/config.json"]
  # Idempotent: the saved (resolved) config resolves to itself.
  assert hf_init_lib.resolve_hf_init(resolved).to_dict() == resolved.to_dict()
  # data.tokenizer: None in finetune.py -> init.hf_dir's tokenizer; a value stays; unset
  # without init.hf_dir is a config error naming the fix.
  assert config.data.tokenizer is None and resolved.data.tokenizer == path
  config.data.tokenizer = "byte"
  assert hf_init_lib.resolve_hf_init(config).data.tokenizer == "byte"
  no_hf = finetune.get_config()
  no_hf.data.path = path + "/config.json"
  with pytest.raises(errors.ConfigError, match="data.tokenizer is unset.*init.hf_dir=DIR"):
    val_lib.check_text_data(no_hf.data, no_hf.model)

  # Shape fields are fixed by the weights; another config's values there are an error.
  wrong = tiny.get_config()
  wrong.init.hf_dir = path
  with pytest.raises(errors.ConfigError, match=r"model.vocab_size=72 contradicts .*finetune"):
    hf_init_lib.resolve_hf_init(wrong)
  missing = finetune.get_config()
  missing.init.hf_dir = str(tmp_path / "nope")
  with pytest.raises(errors.ConfigError, match="is not a directory"):
    hf_init_lib.resolve_hf_init(missing)
  os.makedirs(tmp_path / "empty")
  (tmp_path / "empty" / "config.json").write_text("{}")
  missing.init.hf_dir = str(tmp_path / "empty")
  with pytest.raises(errors.ConfigError, match="neither model.safetensors"):
    hf_init_lib.resolve_hf_init(missing)


@pytest.mark.parametrize("param_dtype,tie,max_shard_bytes", [
    ("float32", False, 40_000),  # sharded: several files + index
    ("bfloat16", True, 10**9),
])
def test_our_export_imports_back_exactly(tmp_path, param_dtype, tie, max_shard_bytes):
  """write_hf_dir -> load_hf_params on a (data=2, sequence=4) mesh: the same bits, placed by
  the rules table; re-exporting gives the same files' tensors."""
  cfg = LlamaConfig(**TINY, tie_embeddings=tie, param_dtype=param_dtype)
  path = _ours_dir(tmp_path, cfg, max_shard_bytes)
  files = os.listdir(path)
  assert (convert_hf.INDEX_FILE in files) == (max_shard_bytes < 10**9)
  umask = os.umask(0)
  os.umask(umask)
  # Every file gets the mode of an ordinary new file (safetensors' own is 0600).
  assert {f: oct(os.stat(os.path.join(path, f)).st_mode & 0o777) for f in files} == {
      f: oct(0o666 & ~umask) for f in files}
  with open(os.path.join(path, "config.json")) as f:
    assert json.load(f)["torch_dtype"] == param_dtype
  assert convert_hf.load_hf_config(path, param_dtype=param_dtype) == cfg
  mesh = mesh_lib.make_mesh(MESH)
  params = convert_hf.load_hf_params(path, cfg, mesh=mesh)
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(
      shd.param_shardings(params, mesh))):
    assert got.sharding == want
  expected = jax.tree.map(lambda x: x.astype(cfg.weight_dtype), random_params(cfg))
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(expected)):
    assert got.dtype == want.dtype
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
  again = str(tmp_path / "again")
  export_hf.write_hf_dir(params, cfg, again, max_shard_bytes=max_shard_bytes)
  _assert_bitwise_equal(_tensors(again), _tensors(path))


def test_safetensors_reads_bfloat16_slices_without_torch(tmp_path):
  """The fact HFCheckpoint relies on: safe_open(framework="numpy").get_slice gives bfloat16."""
  from safetensors.numpy import save_file

  x = np.arange(24, dtype=np.float32).reshape(4, 6).astype(ml_dtypes.bfloat16)
  save_file({"x": x}, str(tmp_path / "x.safetensors"))
  with safe_open(str(tmp_path / "x.safetensors"), framework="numpy") as f:
    part = f.get_slice("x")[1:3, 2:5]
  assert part.dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(part.astype(np.float32), x[1:3, 2:5].astype(np.float32))


def test_parse_size():
  assert export_hf.parse_size("5GB") == 5 * 10**9
  assert export_hf.parse_size("20KiB") == 20 * 2**10
  assert export_hf.parse_size("1000") == 1000
  with pytest.raises(export_hf.UsageError, match="max_shard_size"):
    export_hf.parse_size("lots")


# ----------------------------------------------------------------------------------------------
# With transformers
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf():
  reason = ("pip install torch --index-url https://download.pytorch.org/whl/cpu && "
            "pip install -e '.[dev,hf-test]'")
  return pytest.importorskip("torch", reason=reason), pytest.importorskip("transformers",
                                                                          reason=reason)


@pytest.mark.parametrize("tie,rope,shard,dtype", [
    (False, None, True, "float32"),  # GQA, sharded source files
    (True, None, False, "float32"),  # tied embeddings
    (False, "llama3", False, "bfloat16"),  # the usual release format, LLaMA-3 RoPE scaling
])
def test_import_export_reproduces_the_original_tensors(tmp_path, hf, tie, rope, shard, dtype):
  """transformers save_pretrained -> load_hf_params (8-device mesh) -> write_hf_dir: every
  tensor bitwise equal to the original file's, config loads in transformers with the same
  shape and RoPE, the tokenizer/generation files are copied."""
  torch, transformers = hf
  from test_convert_hf import LLAMA3_ROPE, _hf_model

  model, path = _hf_model(tmp_path, tie=tie, rope_scaling=LLAMA3_ROPE if rope else None,
                          shard=shard, vocab_size=256, hidden_size=64, intermediate_size=128)
  if dtype == "bfloat16":
    model = model.to(torch.bfloat16)
    path = str(tmp_path / "bf16")
    model.save_pretrained(path, safe_serialization=True)
  (tmp_path / "tokenizer_config.json").write_text('{"model_max_length": 64}')
  os.replace(tmp_path / "tokenizer_config.json", os.path.join(path, "tokenizer_config.json"))
  cfg = convert_hf.load_hf_config(path, param_dtype=dtype)
  params = convert_hf.load_hf_params(path, cfg, mesh=mesh_lib.make_mesh(MESH))
  out = str(tmp_path / "export")
  written = export_hf.write_hf_dir(params, cfg, out, hf_dir=path,
                                   max_shard_bytes=40_000 if shard else 5 * 10**9)
  assert "tokenizer_config.json" in written and "generation_config.json" in written
  assert (convert_hf.INDEX_FILE in written) == shard
  _assert_bitwise_equal(_tensors(out), _tensors(path))
  original = transformers.AutoConfig.from_pretrained(path)
  exported = transformers.AutoConfig.from_pretrained(out)
  for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "tie_word_embeddings",
              "rms_norm_eps", "max_position_embeddings"):
    assert getattr(exported, key) == getattr(original, key), key
  rope_of = lambda c: (getattr(c, "rope_parameters", None) or
                       dict(getattr(c, "rope_scaling", None) or {},
                            rope_theta=c.rope_theta))
  assert rope_of(exported) == rope_of(original)
  dtype_of = lambda c: str(getattr(c, "dtype", None) or c.torch_dtype)  # transformers 5 / 4
  assert dtype_of(exported) == dtype_of(original) and dtype_of(exported).endswith(dtype)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_family_import_export_is_bitwise_and_same_architecture(tmp_path, hf, family):
  """Each family (test_convert_hf.FAMILY_CASES) -> load_hf_params (8-device mesh) ->
  write_hf_dir: every tensor (biases, q/k norms included) bitwise equal, and config.json the
  same architecture with the same window and RoPE fields as transformers reads them."""
  torch, transformers = hf
  from test_convert_hf import hf_family_model

  path = str(tmp_path / family)
  hf_family_model(family, path)
  cfg = convert_hf.load_hf_config(path)
  params = convert_hf.load_hf_params(path, cfg, mesh=mesh_lib.make_mesh(MESH))
  out = str(tmp_path / "export")
  export_hf.write_hf_dir(params, cfg, out, hf_dir=path)
  _assert_bitwise_equal(_tensors(out), _tensors(path))
  assert convert_hf.load_hf_config(out) == cfg
  original = transformers.AutoConfig.from_pretrained(path)
  exported = transformers.AutoConfig.from_pretrained(out)
  assert type(exported) is type(original) and exported.architectures == original.architectures
  for key in ("sliding_window", "layer_types", "use_sliding_window", "max_window_layers",
              "tie_word_embeddings", "head_dim", "max_position_embeddings", "rope_parameters"):
    if key == "max_position_embeddings" and (cfg.rope_scaling or {}).get("rope_type") == "yarn":
      # qwen3's YaRN: 4 x 16 positions, where the source's 128 implies a factor of 8
      # (transformers warns on it); the export writes the context the scaling extends to.
      yarn = cfg.rope_scaling
      assert exported.max_position_embeddings == (
          yarn["original_max_position_embeddings"] * yarn["factor"]) == 64
      continue
    assert getattr(exported, key, None) == getattr(original, key, None), key


# ----------------------------------------------------------------------------------------------
# The README's "fine-tune a Hugging Face model" block, run as written (fewer steps)
# ----------------------------------------------------------------------------------------------

# Appended to the block's train.py command: later --config.* flags win, so the test is fast.
_FAST = ["--config.total_steps=2", "--config.optim.warmup_steps=1", "--config.data.seq_len=64",
         "--config.batch_size=4", "--config.eval_batch_size=4", "--config.eval_batches=1",
         "--config.async_checkpointing=False"]


def readme_finetune_commands() -> list[list[str]]:
  """The ``python ...`` commands of the README's bash block that runs make_tiny_hf.py."""
  import shlex
  text = open(os.path.join(ROOT, "README.md")).read()
  blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
  block = next(b for b in blocks if "make_tiny_hf.py" in b)
  lines = [line for line in block.replace("\\\n", " ").splitlines()
           if line.strip() and not line.lstrip().startswith("#")]
  commands = []
  for line in lines:
    for part in line.split("&&"):
      argv = shlex.split(part)
      if argv and argv[0] == "python":
        commands.append(argv)
  return commands


def test_readme_finetune_block_gives_another_family_its_own_paths():
  """The block's note on ``--family`` maps every directory its commands write (``--out``,
  ``--workdir``) to a new one: the same paths would resume the first family's run."""
  text = open(os.path.join(ROOT, "README.md")).read()
  block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "make_tiny_hf.py" in b)
  note = " ".join(l.lstrip("# ").strip() for l in block.splitlines() if l.startswith("#"))
  m = re.search(r"--family \S+ writes that architecture instead; run the same commands with "
                r"new paths for it \(e\.g\. (?P<new>[^()]*?) for (?P<old>[^()]*?)\)", note)
  assert m, note
  paths = lambda s: re.findall(r"/tmp/[\w.]+", s)
  written = {argv[i + 1] for argv in readme_finetune_commands() for i, a in enumerate(argv[:-1])
             if a in ("--out", "--workdir")}
  assert written == {"/tmp/tiny_hf", "/tmp/tiny_ft", "/tmp/tiny_ft_hf"}
  assert sorted(paths(m["old"])) == sorted(written)
  new = paths(m["new"])
  assert len(set(new)) == len(written) and not set(new) & written


def _run_readme_finetune_block(directory) -> dict:
  """make_tiny_hf.py -> train.py (configs/finetune.py, the BPE tokenizer from init.hf_dir)
  -> export_hf.py -> generate.py, as the README writes them (``/tmp/`` paths moved into
  ``directory``); returns each command's argv and stdout."""
  commands = readme_finetune_commands()
  assert [c[1] for c in commands] == ["scripts/make_tiny_hf.py", "train.py", "export_hf.py",
                                      "generate.py"]
  env = train_procs.env()  # train.py sizes its own devices
  runs = []
  for argv in commands:
    argv = [sys.executable] + [a.replace("/tmp/", f"{directory}/") for a in argv[1:]]
    if argv[1] == "train.py":
      argv += _FAST
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, " ".join(argv) + "\n" + proc.stdout[-3000:] + proc.stderr[-3000:]
    runs.append(dict(argv=argv, stdout=proc.stdout, stderr=proc.stderr))
  return dict(dir=str(directory), runs=runs)


@pytest.fixture
def readme_run(tmp_path_factory):
  """The README block's run, made once for the tests below (train_procs.shared_run)."""
  pytest.importorskip("tokenizers")
  run = train_procs.shared_run(tmp_path_factory, "readme-finetune", _run_readme_finetune_block)
  return pathlib.Path(run["dir"]), run["runs"]


def test_readme_finetune_block_runs(readme_run):
  """The README's commands run as written and leave what they say: the run records its
  tokenizer, the export holds weights and tokenizer, generate.py prints BPE text."""
  tmp, runs = readme_run
  # export_hf.py prints its one line, and nothing else (no Orbax INFO or warnings).
  assert runs[2]["stderr"] == "" and runs[2]["stdout"].count("\n") == 1, runs[2]
  assert runs[2]["stdout"].startswith("exported step ")
  saved = json.loads((tmp / "tiny_ft" / "config.json").read_text())
  assert saved["data"]["tokenizer"] == str(tmp / "tiny_hf")  # recorded in the run
  assert saved["data"]["kind"] == "text" and saved["model"]["attention"] == "ring"
  assert f"initialised from {tmp / 'tiny_hf'}" in runs[1]["stdout"]
  assert {"tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= set(
      os.listdir(tmp / "tiny_ft_hf"))
  from training.tokenizer import load_tokenizer
  tok = load_tokenizer(str(tmp / "tiny_hf"))
  text = runs[-1]["stdout"].rstrip("\n")
  assert text, runs[-1]["stderr"][-2000:]
  # The continuation is BPE text: it re-encodes into ids of that tokenizer's vocabulary.
  assert tok.kind == "tokenizers" and len(tok.encode(text)) >= 1


def test_finetune_export_loads_in_transformers(readme_run, hf, tmp_path):
  """The README's run (a random HF LLaMA + BPE tokenizer from make_tiny_hf.py -> train.py on
  configs/finetune.py: ring attention on data=2 x sequence=4 -> export_hf.py) checked against
  transformers: the export loads with logits equal to ours from the trained checkpoint
  (float32, rtol 1e-4), the weights moved, and generate.py's greedy text (the README's
  command, stopping at EOS) equals transformers' greedy generate on the export, token for
  token. (A config override such as rope_theta reaching the run is test_resolve_hf_init's.)"""
  torch, transformers = hf
  from test_convert_hf import _ring_logits
  from training.tokenizer import load_tokenizer

  tmp, runs = readme_run
  source, workdir, out = tmp / "tiny_hf", tmp / "tiny_ft", tmp / "tiny_ft_hf"
  steps = int(next(a for a in runs[1]["argv"][::-1] if a.startswith("--config.total_steps="))
              .split("=")[1])
  assert f"exported step {steps}" in runs[2]["stdout"]
  saved = json.loads((workdir / "config.json").read_text())
  assert json.loads((out / "config.json").read_text())["rope_theta"] == saved["model"][
      "rope_theta"]
  with pytest.raises(export_hf.UsageError, match="not empty"):  # never overwrites
    export_hf.export(str(workdir), str(out))
  with pytest.raises(export_hf.UsageError, match=f"no checkpoint of step {steps - 1}"):
    export_hf.export(str(workdir), str(tmp_path / "other"), step=steps - 1)

  # Ours: the trained checkpoint, ring attention on the training mesh.
  config = export_hf.read_run_config(str(workdir))
  model_cfg = val_lib.llama_config(config)
  # model.layout="auto", resolved at startup and saved as such: packed text, a ring of 4.
  assert (model_cfg.attention, model_cfg.layout) == ("ring", "document")
  assert "layout: auto -> document (packed rows: several documents per row" in runs[1]["stdout"]
  step, params = export_hf.restore_params(str(workdir), model_cfg, None)
  assert step == steps
  name = "model.layers.0.mlp.up_proj.weight"
  assert not np.array_equal(_tensors(str(out))[name], _tensors(str(source))[name])
  mesh = mesh_lib.make_mesh(MESH)
  tokens_BL = np.random.default_rng(2).integers(0, model_cfg.vocab_size, size=(2, 64))
  # One sequence per row here: the document layout deals a lone document as zigzag does.
  ours = _ring_logits(shd.shard_params(params, mesh),
                      dataclasses.replace(model_cfg, layout="zigzag"), mesh, tokens_BL)

  reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
  assert reloaded.dtype == torch.float32
  with torch.no_grad():
    theirs = reloaded(torch.tensor(tokens_BL, dtype=torch.long)).logits.numpy()
  assert np.abs(theirs).max() > 1.0
  np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)

  # generate.py as the README runs it (the run's tokenizer, greedy, stopping at EOS).
  argv = runs[3]["argv"]
  prompt_text = argv[argv.index("--prompt") + 1]
  max_new = int(argv[argv.index("--max_new_tokens") + 1])
  assert argv[argv.index("--temperature") + 1] == "0"
  tok = load_tokenizer(str(source))
  prompt = tok.encode_document(prompt_text, bos=True, eos=False).tolist()
  assert prompt[0] == tok.bos_id and len(prompt) > 2
  # The exported tokenizer, as transformers loads it, encodes as the run's did: BOS and EOS
  # (its config's add_bos_token / add_eos_token) around the text.
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
  for text in (prompt_text, "Each device holds one chunk.", ""):
    assert hf_tok(text).input_ids == tok.encode_document(text).tolist(), text
  assert hf_tok(prompt_text).input_ids[:-1] == prompt
  # generate.py samples only ids the tokenizer has (its vocab_limit); so does this.
  reloaded.generation_config.eos_token_id = None
  reloaded.generation_config.pad_token_id = 0
  unused = list(range(tok.vocab_size, reloaded.config.vocab_size))
  with torch.no_grad():
    out_ids = reloaded.generate(torch.tensor([prompt]), max_new_tokens=max_new,
                                do_sample=False, suppress_tokens=unused or None,
                                attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
  want = out_ids[0, len(prompt):].tolist()
  if tok.eos_id in want:  # generate.py stops at EOS (the README's command does not say not to)
    want = want[:want.index(tok.eos_id)]
  assert runs[3]["stdout"][:-1] == tok.decode(want), (runs[3]["stdout"], want)




def test_qwen3_yarn_finetune_export_generate(tmp_path, hf):
  """A Qwen3 directory (make_tiny_hf.py --family qwen3: q/k norms, head_dim 32, tied) goes
  through train.py with YaRN switched on (configs/finetune.py, ring attention on data=2 x
  sequence=4), export_hf.py and generate.py with the commands of a LLaMA one: the export is
  a Qwen3ForCausalLM with YaRN that transformers loads with logits equal to ours (rtol 1e-4),
  and greedy generate.py equals transformers' greedy generate on it."""
  torch, transformers = hf
  pytest.importorskip("tokenizers")
  import generate
  import train as train_script
  from configs import finetune
  from scripts import make_tiny_hf
  from test_convert_hf import _hf_greedy, _ring_logits
  from training import flags as flags_lib

  source, corpus = str(tmp_path / "qwen3"), str(tmp_path / "corpus.jsonl")
  texts = make_tiny_hf.corpus_texts(60)
  make_tiny_hf.write_corpus(corpus, texts)
  make_tiny_hf.write_tokenizer(source, texts, 264)
  make_tiny_hf.write_model(source, vocab_size=264, family="qwen3")
  yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
  config = flags_lib.apply_overrides(finetune.get_config(), {
      "init.hf_dir": source, "data.path": corpus, "data.seq_len": 64, "batch_size": 4,
      "eval_batch_size": 4, "eval_batches": 1, "total_steps": 2, "optim.warmup_steps": 1,
      "optim.lr": 1e-3, "log_every": 1, "async_checkpointing": False}.items())
  config.model.rope_scaling = yarn  # the context-extension switch: YaRN on a plain-RoPE model
  workdir, out = str(tmp_path / "run"), str(tmp_path / "export")
  # What train.py's main does before training: resolve, then save the run's config.json.
  config = val_lib.resolve_run(hf_init_lib.resolve_hf_init(config), jax.device_count())
  os.makedirs(workdir)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))
  train_script.train(config, workdir)
  export_hf.export(workdir, out, log=lambda _: None)

  exported = json.loads(open(os.path.join(out, "config.json")).read())
  assert (exported["model_type"], exported["architectures"]) == ("qwen3", ["Qwen3ForCausalLM"])
  assert exported["rope_scaling"] == yarn and exported["tie_word_embeddings"] is True
  run_config = export_hf.read_run_config(workdir)
  model_cfg = val_lib.llama_config(run_config)
  assert (model_cfg.family, model_cfg.qk_norm, model_cfg.rope_scaling) == ("qwen3", True, yarn)
  step, params = export_hf.restore_params(workdir, model_cfg, None)
  name = "model.layers.0.self_attn.q_norm.weight"
  assert not np.array_equal(_tensors(out)[name], _tensors(source)[name])  # it trained
  mesh = mesh_lib.make_mesh(MESH)
  tokens_BL = np.random.default_rng(3).integers(0, model_cfg.vocab_size, size=(2, 64))
  ours = _ring_logits(shd.shard_params(params, mesh),
                      dataclasses.replace(model_cfg, layout="zigzag"), mesh, tokens_BL)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  assert type(reloaded).__name__ == "Qwen3ForCausalLM"
  with torch.no_grad():
    theirs = reloaded(torch.tensor(tokens_BL, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)

  prompt = [5, 9, 17, 33, 2, 8, 41]
  texts_out = generate.run(run_config, workdir=workdir, prompts=[" ".join(map(str, prompt))],
                           max_new_tokens=12, temperature=0.0, top_p=1.0, seed=0,
                           tokenizer="ids", out=io.StringIO(), log=lambda _: None)
  assert [int(t) for t in texts_out[0].split()] == _hf_greedy(reloaded, prompt, 12)


def _bpe_dir(path, texts, *, post_processor=None, config=None) -> str:
  """make_tiny_hf.py's BPE (specials <unk> <s> </s>) in ``path``: its tokenizer_config.json
  replaced by ``config`` (None: none at all), its post-processor by ``post_processor``."""
  from scripts import make_tiny_hf

  make_tiny_hf.write_tokenizer(str(path), texts, 300)
  os.remove(os.path.join(path, "tokenizer_config.json"))
  if config is not None:
    (path / "tokenizer_config.json").write_text(json.dumps(config))
  if post_processor is not None:
    import tokenizers
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    tok.post_processor = post_processor
    tok.save(str(path / "tokenizer.json"))
  return str(path)


@pytest.mark.parametrize("kind", ["fixture", "bos_template", "none", "config_drops_bos"])
def test_exported_tokenizer_encodes_as_the_run_did(tmp_path, hf, kind):
  """write_hf_tokenizer_json (what export_hf.py writes as tokenizer.json): transformers'
  AutoTokenizer on the export encodes a text to training/tokenizer.py's encode_document ids,
  for make_tiny_hf.py's tokenizer (add_bos_token/add_eos_token in its config, no template:
  transformers added neither), a LLaMA-3 style BOS template without config flags (kept as
  is), one that adds nothing, and a config that turns the template's BOS off."""
  _, transformers = hf
  pytest.importorskip("tokenizers")
  from tokenizers import processors
  from scripts import make_tiny_hf
  from training import tokenizer as tok_lib

  texts = make_tiny_hf.corpus_texts(60)
  bos = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                      special_tokens=[("<s>", 1)])
  source = _bpe_dir(tmp_path / "src", texts, **{
      "fixture": dict(config=make_tiny_hf.TOKENIZER_CONFIG),
      "bos_template": dict(post_processor=bos),
      "none": dict(),
      "config_drops_bos": dict(post_processor=bos, config={"add_bos_token": False}),
  }[kind])
  tok = tok_lib.load_tokenizer(source)
  want_specials = {"fixture": ([1], [2]), "bos_template": ([1], []), "none": ([], []),
                   "config_drops_bos": ([], [])}[kind]
  out = tmp_path / "out"
  out.mkdir()
  tok_lib.write_hf_tokenizer_json(source, str(out / "tokenizer.json"))
  if os.path.exists(os.path.join(source, "tokenizer_config.json")):
    shutil.copyfile(os.path.join(source, "tokenizer_config.json"), out / "tokenizer_config.json")
  if kind == "bos_template":  # already what training adds: copied byte for byte
    src = tmp_path / "src" / "tokenizer.json"
    assert (out / "tokenizer.json").read_bytes() == src.read_bytes()
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
  for text in ("The ring passes key and value blocks.", "a", ""):
    ids = tok.encode_document(text).tolist()
    head, tail = want_specials
    assert ids == head + tok.encode(text).tolist() + tail
    assert hf_tok(text).input_ids == ids, (kind, text)
  assert hf_tok.decode(hf_tok("The ring").input_ids, skip_special_tokens=True) == "The ring"

