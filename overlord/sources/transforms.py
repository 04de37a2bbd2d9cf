"""Per-record transforms: a source's ``transform: module:function`` (text in, text out).

A transform runs on the SourceLoader, once per record, after the record is read
and before it is tokenized, so its cost is paid once per job, not once per rank.
It must be a pure function of the record (the order and the items depend on its
output). A record it rejects (it raises) is a bad record: it names the source,
file and row, and ``on_error: skip`` skips it.
"""

from __future__ import annotations

import base64
import functools
import html
import importlib
import json
import re
import unicodedata
import zlib
from collections.abc import Callable

from overlord.plan.rules import BUILTIN_TRANSFORMS

Transform = Callable[[str], str]


@functools.cache
def load_transform(name: str, allow_imports: bool = False) -> Transform:
    """The function ``module:function``; ValueError says what is wrong with the name.

    Only overlord's own transforms load unless ``allow_imports`` (the plan's
    ``transforms.allow_imports``) is set: the plan's check refuses the others, and this
    refuses them again where the code would run.
    """
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ValueError(f"'{name}' is not 'module:function'")
    if not allow_imports and name not in BUILTIN_TRANSFORMS:
        raise ValueError(
            f"'{name}' is code from outside overlord, and the plan does not allow it "
            "(transforms: {allow_imports: true})"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import module '{module_name}': {e}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"module '{module_name}' has no function '{attr}'")
    return fn


def zlib_json(text: str) -> str:
    """A record stored packed: base64 of zlib-compressed JSON ``{"text": ...}``; its text.

    >>> packed = base64.b64encode(zlib.compress(json.dumps({"text": "hi"}).encode())).decode()
    >>> zlib_json(packed)
    'hi'
    """
    payload = json.loads(zlib.decompress(base64.b64decode(text)))
    out: str = payload["text"]
    return out


_SPACE = re.compile(r"\s+")


def clean_text(text: str) -> str:
    """Web text cleaned: HTML entities decoded, Unicode NFKC-normalized, whitespace collapsed.

    >>> clean_text("caf&eacute;  \uff46ine&lt;br&gt;")
    'café fine<br>'
    """
    return _SPACE.sub(" ", unicodedata.normalize("NFKC", html.unescape(text))).strip()


def pack_zlib_json(text: str) -> str:
    """The inverse of :func:`zlib_json` (to write such a source)."""
    return base64.b64encode(zlib.compress(json.dumps({"text": text}).encode())).decode()
