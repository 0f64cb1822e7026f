"""The trained model of a run, for the scripts that read one (generate.py, evaluate.py).

:func:`load_model` restores the parameters of the newest checkpoint in a
train.py workdir that restores (:meth:`training.checkpoint.Checkpointer.restore_latest`
without an optimizer target, read only: nothing is moved) onto the shardings of the given mesh, or converts
a local Hugging Face LLaMA directory (:mod:`models.convert_hf`). Errors are
:class:`training.config.UsageError` lines naming the fix.
"""

from __future__ import annotations

import sys
from typing import Callable

from training import checkpoint as ckpt_lib
from training import config as cfg_lib
from training import step as step_lib


def _stderr(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def restore_params(model_cfg, mesh, workdir: str, warn: Callable[[str], None] = _stderr):
  """``(step, params)``: the newest restorable checkpoint of ``workdir``, sharded on ``mesh``."""
  _, target, _ = step_lib.abstract_model(model_cfg, mesh)
  try:
    checkpointer = ckpt_lib.Checkpointer(workdir, read_only=True)
  except ckpt_lib.NoCheckpointError:
    raise cfg_lib.UsageError(
        f"--workdir {workdir} has no checkpoints/ directory; train first (python train.py "
        f"--config ... --workdir {workdir}) or pass --hf_dir.") from None
  try:
    restored = checkpointer.restore_latest(target, warn=warn)
  except ckpt_lib.NoRestorableCheckpointError as e:
    raise cfg_lib.UsageError(str(e)) from None
  finally:
    checkpointer.close()
  if restored is None:
    raise cfg_lib.UsageError(f"{checkpointer.directory} holds no checkpoint; train first or "
                             "pass --hf_dir.")
  step, params, _, _ = restored
  return step, params


def load_model(config, mesh, *, workdir: str | None = None, hf_dir: str | None = None,
               log: Callable[[str], None] = _stderr):
  """``(LlamaConfig, params State sharded on mesh)`` from ``hf_dir`` if given, else ``workdir``.

  With ``workdir`` the model is ``config.model``'s; with ``hf_dir`` it is the
  Hugging Face config's, run with ``config.model``'s attention, layout, blocks
  and dtypes.
  """
  if hf_dir:
    from flax import nnx
    from models import convert_hf
    m = config.model
    model = convert_hf.load_hf_checkpoint(
        hf_dir, mesh=mesh, attention=m.attention, layout=m.layout, block_q=m.block_q,
        block_kv=m.block_kv, dtype=m.dtype, param_dtype=m.param_dtype)
    log(f"loaded {hf_dir}")
    return model.cfg, nnx.split(model, nnx.Param, ...)[1]
  model_cfg = cfg_lib.llama_config(config)
  step, params = restore_params(model_cfg, mesh, workdir, warn=log)
  log(f"restored step {step} from {workdir}")
  return model_cfg, params
