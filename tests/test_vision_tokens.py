"""Image-text sources: the image token's id (``auto``, given) and gzipped tars, end to end.

``image_token_id: auto`` is 258 for the bytes tokenizer and the id of
``<|image_pad|>`` for an ``hf`` one, which must have it (else the plan gives
the id); a ``.tar.gz`` shard reads as its ``.tar`` does.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from overlord.errors import PlanError
from overlord.ops.vision_data import image_text_tar, random_images
from overlord.plan.spec import validate_plan
from overlord.plan.vision import VisionSpec
from overlord.sources.catalog import list_files
from overlord.sources.images import image_token_id
from overlord.sources.shard import load_shard_items
from overlord.sources.tokenizers import BytesTokenizer, HFTokenizer, make_tokenizer


def hf_file(path: Path, pad: bool) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "</s>": 1, "image": 2, "a": 3, "picture": 4}
    if pad:
        vocab["<|image_pad|>"] = 7
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def test_auto_is_258_for_bytes_and_image_pad_for_hf(tmp_path: Path) -> None:
    auto = VisionSpec()
    assert image_token_id(auto, BytesTokenizer()) == 258
    hf = HFTokenizer(str(hf_file(tmp_path / "t.json", pad=True)), eos="</s>")
    assert image_token_id(auto, hf) == 7
    assert image_token_id(VisionSpec(image_token_id=5), hf) == 5  # given: used as is
    bare = HFTokenizer(str(hf_file(tmp_path / "u.json", pad=False)), eos="</s>")
    with pytest.raises(PlanError, match=r"vision\.image_token_id.*<\|image_pad\|>"):
        image_token_id(auto, bare)
    assert image_token_id(VisionSpec(image_token_id=5), bare) == 5


def plan(root: Path, path: str, **over: Any) -> Any:
    data: dict[str, Any] = {
        "sources": [{"name": "w", "path": path, "format": "webdataset", "text_field": "txt"}],
        "batch": {"tokens_per_step": 4096, "max_seq_len": 2048},
        "vision": {},
        "shuffle": {"block_bytes": 4096},
    }
    return validate_plan(data | over, base_dir=root)


def items(p: Any) -> Any:
    spec = p.sources[0]
    files = list_files(spec.name, [spec.path], str(p.base_dir))
    return load_shard_items(p, spec, files, make_tokenizer(p.tokenizer, str(p.base_dir)), 0, 0)


def test_hf_captions_follow_their_image_pad_tokens(tmp_path: Path) -> None:
    hf_file(tmp_path / "t.json", pad=True)
    image_text_tar(tmp_path / "a.tar", random_images(3, seed=2, sizes=(20, 90)), json_every=0)
    got = items(plan(tmp_path, "a.tar", tokenizer={"kind": "hf", "path": "t.json", "eos": "</s>"}))
    for j in range(len(got)):
        n_img = int(got.grid[j][0] * got.grid[j][1]) // 4
        toks = got.tokens[got.start[j] : got.start[j] + got.length[j]].tolist()
        # caption(i) is "image i: a picture of something. ...": image, [UNK], [UNK], a, picture
        assert toks[:n_img] == [7] * n_img and toks[n_img : n_img + 5] == [2, 0, 0, 3, 4]
        assert toks[-1] == 1


def test_a_gzipped_tar_reads_as_the_tar(tmp_path: Path) -> None:
    image_text_tar(tmp_path / "a.tar", random_images(6, seed=3, sizes=(20, 120)))
    (tmp_path / "gz").mkdir()
    (tmp_path / "gz" / "a.tar.gz").write_bytes(gzip.compress((tmp_path / "a.tar").read_bytes()))
    plain, gz = items(plan(tmp_path, "a.tar")), items(plan(tmp_path, "gz/a.tar.gz"))
    assert len(plain) == len(gz) == 6
    assert plain.keys == gz.keys and np.array_equal(plain.tokens, gz.tokens)
    assert np.array_equal(plain.pixels, gz.pixels) and np.array_equal(plain.grid, gz.grid)
