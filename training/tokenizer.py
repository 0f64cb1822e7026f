"""Tokenizers for the text pipeline: bytes, a Hugging Face ``tokenizer.json``, SentencePiece.

``load_tokenizer(spec)`` is the one entry point (``config.data.tokenizer``):

* ``"byte"``: UTF-8 bytes shifted past three special ids (PAD 0, BOS 1, EOS 2), vocab 259.
* a ``tokenizer.json`` file: the ``tokenizers`` package (a Hugging Face fast tokenizer).
* a ``*.model`` file: a SentencePiece model (the ``sentencepiece`` package).
* a directory holding one of them (a Hugging Face model directory): ``tokenizer.json`` is
  preferred over ``tokenizer.model`` when both exist (it is what ``transformers`` loads).

Every tokenizer encodes a document as ``[BOS] ids [EOS]``, each special added when the
tokenizer's own configuration says so:

* ``tokenizer_config.json`` / ``special_tokens_map.json`` next to the tokenizer file:
  ``add_bos_token`` / ``add_eos_token`` and the ``bos_token`` / ``eos_token`` strings;
* otherwise, for ``tokenizer.json``: what its post-processor adds around a text (a
  LLaMA-3 style template adds ``<|begin_of_text|>``);
* otherwise, for SentencePiece: BOS and EOS whenever the model defines them (``bos_id()``,
  ``eos_id()`` >= 0).

Nothing is fetched: the files are local.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import numpy as np

# Byte-level tokenizer: ids 0..2 are special, byte b is id b + 3.
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
BYTE_OFFSET = 3
BYTE_VOCAB_SIZE = 256 + BYTE_OFFSET

BYTE = "byte"
_HF_FILE, _SP_FILE = "tokenizer.json", "tokenizer.model"


def byte_tokenize(text: str) -> np.ndarray:
  """UTF-8 bytes shifted past the special ids, wrapped in BOS ... EOS."""
  ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) + BYTE_OFFSET
  return np.concatenate([[BOS_ID], ids, [EOS_ID]]).astype(np.int32)


def byte_detokenize(ids) -> str:
  ids = np.asarray(ids)
  ids = ids[ids >= BYTE_OFFSET] - BYTE_OFFSET
  return bytes(ids.astype(np.uint8).tolist()).decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  """A loaded tokenizer: ``encode``/``decode`` text, and the ids it wraps documents in.

  ``vocab_size`` is the number of ids the tokenizer can emit (largest id + 1), which
  must not exceed ``model.vocab_size``. ``bos_id`` / ``eos_id`` are None when the
  tokenizer has no such token; ``add_bos`` / ``add_eos`` say whether
  :meth:`encode_document` puts them around every document.
  """
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
    if self.kind == "byte":
      return (np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
              + BYTE_OFFSET)
    if self.kind == "tokenizers":
      return np.asarray(self._impl.encode(text, add_special_tokens=False).ids, np.int32)
    return np.asarray(self._impl.encode(text), np.int32)

  def encode_document(self, text: str, *, bos: bool = True, eos: bool = True) -> np.ndarray:
    """``[BOS] encode(text) [EOS]`` with each special as the tokenizer adds it.

    ``bos=False`` / ``eos=False`` leave them out for a piece that does not start / end
    its document (a ``.txt`` file read in several pieces).
    """
    return self._wrap(self.encode(text), bos, eos)

  def encode_documents(self, pieces: list[tuple[str, bool, bool]]) -> list[np.ndarray]:
    """:meth:`encode_document` of each ``(text, bos, eos)``, in one native batch call.

    ``tokenizers``' ``encode_batch`` and SentencePiece's list ``encode`` tokenise on
    their own native threads.
    """
    texts = [text for text, _, _ in pieces]
    if self.kind == "tokenizers":
      ids = [e.ids for e in self._impl.encode_batch(texts, add_special_tokens=False)]
    elif self.kind == "sentencepiece":
      ids = self._impl.encode(texts)
    else:
      ids = [self.encode(t) for t in texts]
    return [self._wrap(np.asarray(i, np.int32), bos, eos)
            for i, (_, bos, eos) in zip(ids, pieces)]

  def _wrap(self, ids: np.ndarray, bos: bool, eos: bool) -> np.ndarray:
    head = [self.bos_id] if bos and self.add_bos else []
    tail = [self.eos_id] if eos and self.add_eos else []
    if head or tail:
      ids = np.concatenate([np.asarray(head, np.int32), ids, np.asarray(tail, np.int32)])
    return ids.astype(np.int32)

  def decode(self, ids) -> str:
    """Text of ``ids``; special tokens are dropped."""
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    if self.kind == "byte":
      return byte_detokenize(ids)
    if self.kind == "tokenizers":
      return self._impl.decode(ids, skip_special_tokens=True)
    specials = {i for i in (self.bos_id, self.eos_id, self._impl.pad_id()) if i is not None}
    return self._impl.decode([i for i in ids if i not in specials and i >= 0])


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _token_content(token) -> str | None:
  """``bos_token`` in a tokenizer config is a string or an AddedToken dict."""
  if isinstance(token, dict):
    return token.get("content")
  return token if isinstance(token, str) else None


def _special_settings(directory: str) -> dict:
  """bos/eos strings and add_bos/add_eos flags from the HF config files in ``directory``."""
  merged = {}
  for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
    cfg = _read_json(os.path.join(directory, name))
    for key in ("bos_token", "eos_token"):
      if _token_content(cfg.get(key)) is not None:
        merged[key] = _token_content(cfg[key])
    for key in ("add_bos_token", "add_eos_token"):
      if isinstance(cfg.get(key), bool):
        merged[key] = cfg[key]
  return merged


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


def _load_tokenizers(path: str, spec: str) -> Tokenizer:
  import tokenizers  # Local: only the HF path needs the package (the `hf` extra).

  tok = tokenizers.Tokenizer.from_file(path)
  settings = _special_settings(os.path.dirname(path))
  # What the post-processor wraps a text in (e.g. a template "<s> $A" or "$A </s>").
  plain = tok.encode("a", add_special_tokens=False).ids
  full = tok.encode("a", add_special_tokens=True).ids
  start = next((i for i in range(len(full) - len(plain) + 1)
                if full[i:i + len(plain)] == plain), 0)
  head, tail = full[:start], full[start + len(plain):]

  def token_id(key, fallback):
    content = settings.get(key)
    if content is not None:
      found = tok.token_to_id(content)
      if found is None:
        raise ValueError(f"data.tokenizer={spec!r}: {key} {content!r} of its tokenizer config is "
                         "not in the vocabulary.")
      return found
    return fallback

  bos_id = token_id("bos_token", head[0] if len(head) == 1 else None)
  eos_id = token_id("eos_token", tail[0] if len(tail) == 1 else None)
  add_bos = settings.get("add_bos_token", len(head) == 1 and head[0] == bos_id)
  add_eos = settings.get("add_eos_token", len(tail) == 1 and tail[0] == eos_id)
  for flag, key, value in ((add_bos, "bos_token", bos_id), (add_eos, "eos_token", eos_id)):
    if flag and value is None:
      raise ValueError(f"data.tokenizer={spec!r}: its config adds a {key} but names none.")
  vocab = max(tok.get_vocab(with_added_tokens=True).values()) + 1
  return Tokenizer(spec=spec, kind="tokenizers", vocab_size=vocab, bos_id=bos_id, eos_id=eos_id,
                   add_bos=bool(add_bos), add_eos=bool(add_eos), _impl=tok)


def _load_sentencepiece(path: str, spec: str) -> Tokenizer:
  import sentencepiece  # Local: only the HF path needs the package (the `hf` extra).

  sp = sentencepiece.SentencePieceProcessor(model_file=path)
  settings = _special_settings(os.path.dirname(path))

  def token_id(key, default):
    content = settings.get(key)
    if content is None:
      return default if default >= 0 else None
    found = sp.piece_to_id(content)
    if found == sp.unk_id() and content != sp.id_to_piece(sp.unk_id()):
      raise ValueError(f"data.tokenizer={spec!r}: {key} {content!r} of its tokenizer config is "
                       "not a piece of the SentencePiece model.")
    return found

  bos_id, eos_id = token_id("bos_token", sp.bos_id()), token_id("eos_token", sp.eos_id())
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
  path = resolve_tokenizer_file(spec)
  if os.path.basename(path) == _HF_FILE or path.endswith(".json"):
    return _load_tokenizers(path, spec)
  return _load_sentencepiece(path, spec)


def load_tokenizer(spec: str | None) -> Tokenizer:
  """The tokenizer ``config.data.tokenizer`` names: "byte", a file, or a model directory.

  Loaded once per spec and process (cached: the trainer, its validation and its eval
  share one). Raises ValueError naming the fix for a path that holds no tokenizer.
  """
  if not spec:
    raise ValueError("data.tokenizer is empty; use 'byte', a tokenizer.json, a SentencePiece "
                     ".model, or a Hugging Face model directory.")
  return _load(spec if spec == BYTE else os.path.abspath(os.path.expanduser(spec)))


def write_hf_tokenizer_json(spec: str, out_path: str) -> None:
  """Writes the ``tokenizer.json`` of ``spec`` (a ``tokenizers`` tokenizer) to ``out_path``
  so that Hugging Face ``transformers`` encodes a text to the ids :meth:`Tokenizer
  .encode_document` gives: ``AutoTokenizer`` adds the specials the file's post-processor
  adds, not what ``tokenizer_config.json``'s ``add_bos_token`` / ``add_eos_token`` say. A
  file whose post-processor already adds exactly ``[BOS]`` / ``[EOS]`` as this tokenizer
  does is copied as is; otherwise its post-processor becomes a ``TemplateProcessing``
  adding them (``"<s>:0 $A:0 </s>:0"``, as transformers' LlamaTokenizerFast writes for
  those flags), after a ``ByteLevel`` one if there is one (offsets only).

  Raises:
    ValueError: ``spec`` is not a ``tokenizer.json`` tokenizer.
  """
  import shutil

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
  specials, single, pair = [], ["$A:0"], ["$B:1"]
  for add, token_id, at in ((tok.add_bos, tok.bos_id, 0), (tok.add_eos, tok.eos_id, None)):
    if not add:
      continue
    content = impl.id_to_token(token_id)
    specials.append((content, token_id))
    for seq, part in ((single, 0), (pair, 1)):
      seq.insert(len(seq) if at is None else at, f"{content}:{part}")
  template = processors.TemplateProcessing(single=" ".join(single),
                                           pair=" ".join(single + pair), special_tokens=specials)
  existing = impl.post_processor
  impl.post_processor = (processors.Sequence([existing, template])
                         if isinstance(existing, processors.ByteLevel) else template)
  got = impl.encode("a", add_special_tokens=True).ids
  if got != want:  # a tokenizer this function does not understand: say so, write nothing
    raise ValueError(f"{spec!r}: the rewritten post-processor encodes 'a' to {got}, not {want}.")
  impl.save(out_path)
