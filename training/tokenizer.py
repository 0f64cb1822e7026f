"""Tokenizers for the text pipeline: bytes, a Hugging Face ``tokenizer.json``, SentencePiece.

:func:`load_tokenizer` loads ``config.data.tokenizer`` (nothing is fetched); a document is
``[BOS] ids [EOS]``, each special token added as docs/training.md ("Data", Tokenizer) says.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil

import numpy as np

# Byte-level tokenizer: ids 0..2 are special, byte b is id b + 3.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3
BYTE_VOCAB_SIZE = 256 + BYTE_OFFSET

BYTE = "byte"
#: The error of a run or script without ``data.tokenizer`` (the fix in it).
UNSET = ("data.tokenizer is unset (configs/finetune.py takes the tokenizer of init.hf_dir): "
         "pass --config.init.hf_dir=DIR or --config.data.tokenizer=(a tokenizer.json, a "
         "SentencePiece .model, a directory, or 'byte').")
_HF_FILE, _SP_FILE = "tokenizer.json", "tokenizer.model"


def byte_detokenize(ids) -> str:
  ids = np.asarray(ids)
  ids = ids[ids >= BYTE_OFFSET] - BYTE_OFFSET
  return bytes(ids.astype(np.uint8).tolist()).decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  """A loaded tokenizer: ``encode``/``decode`` text, and the ids it wraps documents in
  (``bos_id``/``eos_id`` None where it has none); ``vocab_size`` is its largest id + 1."""
  spec: str
  kind: str  # "byte" | "tokenizers" | "sentencepiece"
  vocab_size: int
  bos_id: int | None
  eos_id: int | None
  add_bos: bool
  add_eos: bool
  _impl: object = dataclasses.field(default=None, repr=False, compare=False)

  @property
  def name(self) -> str:
    return "byte" if self.kind == "byte" else f"{self.kind} ({self.spec})"

  def encode(self, text: str) -> np.ndarray:
    """Token ids of ``text`` without any special token, int32."""
    return self.encode_documents([(text, False, False)])[0]

  def encode_document(self, text: str, *, bos: bool = True, eos: bool = True) -> np.ndarray:
    """``[BOS] encode(text) [EOS]`` with each special as the tokenizer adds it; ``bos`` /
    ``eos`` False for a piece that does not start / end its document."""
    return self.encode_documents([(text, bos, eos)])[0]

  def encode_documents(self, pieces: list[tuple[str, bool, bool]]) -> list[np.ndarray]:
    """:meth:`encode_document` of each ``(text, bos, eos)``, in one native batch call."""
    texts = [text for text, _, _ in pieces]
    if self.kind == "tokenizers":
      ids = [e.ids for e in self._impl.encode_batch(texts, add_special_tokens=False)]
    elif self.kind == "sentencepiece":
      ids = self._impl.encode(texts)
    else:
      ids = [np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int32) + BYTE_OFFSET
             for t in texts]
    return [np.concatenate([[self.bos_id] * (bos and self.add_bos), np.asarray(i, np.int32),
                            [self.eos_id] * (eos and self.add_eos)]).astype(np.int32)
            for i, (_, bos, eos) in zip(ids, pieces)]

  def decode(self, ids) -> str:
    """Text of ``ids``; special tokens are dropped."""
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    if self.kind == "byte":
      return byte_detokenize(ids)
    if self.kind == "tokenizers":
      return self._impl.decode(ids, skip_special_tokens=True)
    specials = {i for i in (self.bos_id, self.eos_id, self._impl.pad_id()) if i is not None}
    return self._impl.decode([i for i in ids if i not in specials and i >= 0])


def _special_settings(directory: str) -> dict:
  """bos/eos strings (a token is a string or an AddedToken dict) and add_bos/add_eos flags
  from the HF config files in ``directory``; ``tokenizer_config.json`` wins."""
  merged = {}
  for name in ("special_tokens_map.json", "tokenizer_config.json"):
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
      continue
    with open(path, encoding="utf-8") as f:
      cfg = json.load(f)
    for key, kind in (("bos_token", str), ("eos_token", str), ("add_bos_token", bool),
                      ("add_eos_token", bool)):
      value = cfg.get(key)
      value = value.get("content") if isinstance(value, dict) else value
      if isinstance(value, kind):
        merged[key] = value
  return merged


def _special_ids(spec: str, settings: dict, fallbacks, lookup, known: str) -> list:
  """[bos id, eos id]: of the token ``settings`` names (``lookup(content)``; None: unknown, a
  ValueError saying it is not ``known``), else the ``fallbacks`` one."""
  ids = []
  for key, fallback in zip(("bos_token", "eos_token"), fallbacks):
    content = settings.get(key)
    ids.append(fallback if content is None else lookup(content))
    if ids[-1] is None and content is not None:
      raise ValueError(f"data.tokenizer={spec!r}: {key} {content!r} of its tokenizer config is "
                       f"not {known}.")
  return ids


def resolve_tokenizer_file(spec: str) -> str:
  """The tokenizer file ``spec`` names (a file, or a directory holding one)."""
  if os.path.isdir(spec):
    for name in (_HF_FILE, _SP_FILE):
      if os.path.isfile(os.path.join(spec, name)):
        return os.path.join(spec, name)
    raise ValueError(f"data.tokenizer={spec!r} is a directory without {_HF_FILE} or "
                     f"{_SP_FILE}; point it at a tokenizer file or use 'byte'.")
  if not os.path.isfile(spec):
    raise ValueError(f"data.tokenizer={spec!r} is neither 'byte' nor an existing "
                     f"{_HF_FILE} / SentencePiece .model file or a directory holding one.")
  return spec


def _load_tokenizers(path: str, spec: str, settings: dict) -> Tokenizer:
  import tokenizers  # Local: only the HF path needs the package (the `hf` extra).

  tok = tokenizers.Tokenizer.from_file(path)
  # What the post-processor wraps a text in (e.g. a template "<s> $A" or "$A </s>").
  plain = tok.encode("a", add_special_tokens=False).ids
  full = tok.encode("a", add_special_tokens=True).ids
  start = next((i for i in range(len(full) - len(plain) + 1) if full[i:i + len(plain)] == plain), 0)
  head, tail = full[:start], full[start + len(plain):]
  fallbacks = [w[0] if len(w) == 1 else None for w in (head, tail)]
  bos_id, eos_id = _special_ids(spec, settings, fallbacks, tok.token_to_id, "in the vocabulary")
  add_bos = settings.get("add_bos_token", len(head) == 1 and head[0] == bos_id)
  add_eos = settings.get("add_eos_token", len(tail) == 1 and tail[0] == eos_id)
  for flag, key, value in ((add_bos, "bos_token", bos_id), (add_eos, "eos_token", eos_id)):
    if flag and value is None:
      raise ValueError(f"data.tokenizer={spec!r}: its config adds a {key} but names none.")
  vocab = max(tok.get_vocab(with_added_tokens=True).values()) + 1
  return Tokenizer(spec=spec, kind="tokenizers", vocab_size=vocab, bos_id=bos_id, eos_id=eos_id,
                   add_bos=bool(add_bos), add_eos=bool(add_eos), _impl=tok)


def _load_sentencepiece(path: str, spec: str, settings: dict) -> Tokenizer:
  import sentencepiece  # Local: only the HF path needs the package (the `hf` extra).

  sp = sentencepiece.SentencePieceProcessor(model_file=path)
  unk = sp.unk_id()
  piece = lambda content: (None if (found := sp.piece_to_id(content)) == unk
                           and content != sp.id_to_piece(unk) else found)
  bos_id, eos_id = _special_ids(spec, settings, [i if i >= 0 else None for i in (
      sp.bos_id(), sp.eos_id())], piece, "a piece of the SentencePiece model")
  add_bos = settings.get("add_bos_token", bos_id is not None)
  add_eos = settings.get("add_eos_token", eos_id is not None)
  return Tokenizer(spec=spec, kind="sentencepiece", vocab_size=sp.get_piece_size(),
                   bos_id=bos_id, eos_id=eos_id, add_bos=bool(add_bos and bos_id is not None),
                   add_eos=bool(add_eos and eos_id is not None), _impl=sp)


@functools.lru_cache(maxsize=8)
def _load(spec: str) -> Tokenizer:
  if spec == BYTE:
    return Tokenizer(spec=BYTE, kind="byte", vocab_size=BYTE_VOCAB_SIZE, bos_id=BOS_ID,
                     eos_id=EOS_ID, add_bos=True, add_eos=True)
  path = resolve_tokenizer_file(spec)  # its special tokens: the HF config files beside it
  load = _load_tokenizers if path.endswith(".json") else _load_sentencepiece
  return load(path, spec, _special_settings(os.path.dirname(path)))


def load_tokenizer(spec: str | None) -> Tokenizer:
  """The tokenizer ``config.data.tokenizer`` names (loaded once per spec and process);
  ValueError naming the fix for no spec or a path that holds no tokenizer."""
  if not spec:
    raise ValueError(UNSET)
  return _load(spec if spec == BYTE else os.path.abspath(os.path.expanduser(spec)))


def load_explained(spec: str) -> Tokenizer:
  """:func:`load_tokenizer`, or a ValueError whose message (to follow the spec) says why not:
  the `hf` extra missing, or the file's own error."""
  try:
    return load_tokenizer(spec)
  except ImportError as e:
    raise ValueError(f"needs the `hf` extra (pip install -e '.[hf]'): {e}") from None
  except Exception as e:  # ValueError naming the fix, or the package's own parse error.
    raise ValueError(f"does not load: {e}") from None


def write_hf_tokenizer_json(spec: str, out_path: str) -> None:
  """Writes the ``tokenizer.json`` of ``spec`` (a ``tokenizers`` tokenizer) to ``out_path``
  so that ``transformers`` (which adds what the post-processor adds) encodes a text to the
  ids of :meth:`Tokenizer.encode_document`: copied as is where that holds, else with a
  ``TemplateProcessing`` post-processor adding them (after a ``ByteLevel`` one, if any).
  ValueError for another kind of tokenizer."""
  import tokenizers
  from tokenizers import processors

  tok = load_tokenizer(spec)
  if tok.kind != "tokenizers":
    raise ValueError(f"{spec!r} is a {tok.kind} tokenizer, not a tokenizer.json one.")
  path = resolve_tokenizer_file(spec)
  impl = tokenizers.Tokenizer.from_file(path)
  want = tok.encode_document("a").tolist()
  if impl.encode("a", add_special_tokens=True).ids == want:
    shutil.copyfile(path, out_path)
    return
  bos = [(impl.id_to_token(tok.bos_id), tok.bos_id)] if tok.add_bos else []
  eos = [(impl.id_to_token(tok.eos_id), tok.eos_id)] if tok.add_eos else []
  wrap = lambda seq, part: " ".join(  # [BOS:part] seq [EOS:part]
      [f"{t}:{part}" for t, _ in bos] + [seq] + [f"{t}:{part}" for t, _ in eos])
  single = wrap("$A:0", 0)
  template = processors.TemplateProcessing(single=single, pair=f"{single} {wrap('$B:1', 1)}",
                                           special_tokens=bos + eos)
  existing = impl.post_processor
  impl.post_processor = (processors.Sequence([existing, template])
                         if isinstance(existing, processors.ByteLevel) else template)
  got = impl.encode("a", add_special_tokens=True).ids
  if got != want:  # a tokenizer this function does not understand: say so, write nothing
    raise ValueError(f"{spec!r}: the rewritten post-processor encodes 'a' to {got}, not {want}.")
  impl.save(out_path)
