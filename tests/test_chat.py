"""``format: chat``: conversations rendered by a real chat template, and their loss mask.

The templates are trl 1.16.0's Qwen2.5 templates (tests/data/chat/README.md): one with
``{% generation %}`` marks, checked against ``transformers``' own
``apply_chat_template(..., return_assistant_tokens_mask=True)``, and the same template
without marks, checked against a plain Jinja render with the assistant contents found in
its text. The tokenizer is a byte-level BPE trained here (no model hub), with Qwen's
special tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import make_corpus
from overlord import Loader, load_plan
from overlord.batch.cp import cp_slices
from overlord.batch.rows import IGNORE_INDEX, pack
from overlord.errors import PlanError, SourceError
from overlord.plan.spec import validate_plan
from overlord.sources.chat import ChatRecordError, assistant_mask, encode_chat, plan_template
from overlord.sources.probe import check_sources
from overlord.sources.tokenizers import make_tokenizer
from overlord.world import CPLayout

tokenizers = pytest.importorskip("tokenizers")
jinja2 = pytest.importorskip("jinja2")

TEMPLATES = Path(__file__).parent / "data" / "chat"
MARKED = TEMPLATES / "qwen2_5_training.jinja"
PLAIN = TEMPLATES / "qwen2_5.jinja"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = "the assistant says hello to the user who asks how are you today, héllo wörld 日本"

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hello to you"}],
    [
        {"role": "system", "content": "you are the assistant"},
        {"role": "user", "content": "how are you today?"},
        {"role": "assistant", "content": "héllo wörld, fine"},
        {"role": "user", "content": "and 日本"},
        {"role": "assistant", "content": "  the user asks  "},  # white space kept or trimmed
    ],
    [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hello"},  # the same text as the user's
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "says hello hello"},
    ],
]


def write_tokenizer(folder: Path, template: Path | None = MARKED) -> Path:
    """A byte-level BPE tokenizer.json, and a tokenizer_config.json with ``template``."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIAL,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([WORDS] * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    config: dict[str, Any] = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    if template is not None:
        config["chat_template"] = template.read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def chat_plan(root: Path, records: Any, **overrides: Any) -> Path:
    """A plan of one chat source (JSONL, or Parquet for a name ending .parquet)."""
    name = overrides.pop("file", "a.jsonl")
    source = {"files": {f"data/chat/{name}": records}, "format": "chat"}
    source.update(overrides.pop("source", {}))
    tokenizer = overrides.pop("tokenizer", {"kind": "hf", "path": "tok/tokenizer.json"})
    if tokenizer.get("kind") == "hf":
        write_tokenizer(root / "tok", overrides.pop("template", MARKED))
    return make_corpus(
        root,
        {"chat": source},
        tokenizer=tokenizer,
        batch={"tokens_per_step": 1024, "max_seq_len": 256, **overrides.pop("batch", {})},
        **overrides,
    )


def hf_reference(folder: Path, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """transformers' tokens and assistant mask of a conversation (the marked template)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    out = hf.apply_chat_template(
        messages,
        chat_template=MARKED.read_text(),
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    return list(out["input_ids"]), list(out["assistant_masks"])


def search_reference(folder: Path, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """A plain Jinja render of the unmarked template, the assistant contents searched in it.

    Written apart from overlord's: each assistant content (stripped, as Qwen's template
    does not trim it but a reader may) found after the previous one, with the ``<|im_end|>``
    that follows it; a token is masked when one of its characters lies in such a span.
    """
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(PLAIN.read_text()).render(messages=messages, add_generation_prompt=False)
    inside = np.zeros(len(text) + 1, bool)
    at = 0
    for m in messages:
        if m["role"] != "assistant":
            continue
        content = m["content"] if m["content"] in text[at:] else m["content"].strip()
        start = text.index(content, at)
        end = start + len(content)
        after = text[end:]
        if after.lstrip().startswith("<|im_end|>"):
            end += len(after) - len(after.lstrip()) + len("<|im_end|>")
        inside[start:end] = True
        at = end
    enc = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).encode(
        text, add_special_tokens=False
    )
    mask = [int(inside[a : max(b, a + 1)].any()) for a, b in enc.offsets]
    return enc.ids, mask


def overlord_piece(plan_path: Path, conversations: list[Any]) -> tuple[Any, list[Any], list[Any]]:
    """overlord's tokens and mask of each conversation, through encode_chat."""
    plan = load_plan(plan_path)
    tok = make_tokenizer(plan.tokenizer, str(plan.base_dir))
    texts = pa.array([json.dumps(c) for c in conversations], pa.large_string())
    piece = encode_chat(plan_template(plan), tok, plan.sources[0], texts)
    offs = piece.offsets.tolist()
    cut = list(zip(offs[:-1], offs[1:]))
    return (
        piece,
        [piece.tokens[a:b].tolist() for a, b in cut],
        [(piece.mask[a:b].tolist() if piece.mask is not None else None) for a, b in cut],
    )


# ---- the mask against independent renderings -----------------------------------------------


def test_the_mask_equals_transformers_assistant_mask_on_a_marked_template(tmp_path: Path) -> None:
    plan = chat_plan(tmp_path, [{"messages": CONVERSATIONS[0]}])
    piece, tokens, masks = overlord_piece(plan, CONVERSATIONS)
    assert piece.bad == []
    for conversation, got_tokens, got_mask in zip(CONVERSATIONS, tokens, masks):
        ids, mask = hf_reference(tmp_path / "tok", conversation)
        assert got_tokens == ids
        assert got_mask == mask
        assert 0 < sum(mask) < len(mask)  # a test that can fail: some tokens each way


def test_the_mask_equals_the_contents_found_on_a_template_without_marks(tmp_path: Path) -> None:
    plan = chat_plan(tmp_path, [{"messages": CONVERSATIONS[0]}], template=PLAIN)
    piece, tokens, masks = overlord_piece(plan, CONVERSATIONS)
    assert piece.bad == []
    for conversation, got_tokens, got_mask in zip(CONVERSATIONS, tokens, masks):
        ids, mask = search_reference(tmp_path / "tok", conversation)
        assert got_tokens == ids
        assert got_mask == mask
        # the end of turn is learned; the user's identical "hello" is not
        im_end = tokenizers.Tokenizer.from_file(str(tmp_path / "tok/tokenizer.json")).token_to_id(
            "<|im_end|>"
        )
        ends = [m for t, m in zip(got_tokens, got_mask) if t == im_end]
        assert ends.count(1) == sum(c["role"] == "assistant" for c in conversation)


TEXT = st.lists(st.sampled_from([*"ab hé日\n\t,!", "<|im_end|>", "the "]), max_size=12).map("".join)


@st.composite
def conversations(draw: st.DrawFn) -> list[dict[str, str]]:
    """A system turn or not, then turns of any role order, with at least one assistant."""
    turns = []
    if draw(st.booleans()):
        turns.append({"role": "system", "content": draw(TEXT)})
    roles = draw(st.lists(st.sampled_from(["user", "assistant"]), min_size=1, max_size=5))
    for role in [*roles, "assistant"] if "assistant" not in roles else roles:
        turns.append({"role": role, "content": draw(TEXT)})
    return turns


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(conversations(), min_size=1, max_size=4))
@pytest.mark.parametrize("template", [MARKED, PLAIN], ids=["marked", "plain"])
def test_any_conversation_masks_as_the_reference_does(
    tmp_path: Path, template: Path, convs: list[Any]
) -> None:
    folder = tmp_path / "any"
    if not (folder / "plan.yaml").exists():
        chat_plan(folder, [{"messages": CONVERSATIONS[0]}], template=template)
    reference = hf_reference if template == MARKED else search_reference
    piece, tokens, masks = overlord_piece(folder / "plan.yaml", convs)
    # a conversation whose assistant turns render to nothing has no assistant token: bad
    empty = [i for i, _ in piece.bad]
    for i, conversation in enumerate(convs):
        ids, mask = reference(folder / "tok", conversation)
        if i in empty:
            assert sum(mask) == 0
            continue
        assert (tokens[i], masks[i]) == (ids, mask)


def test_the_appended_end_of_document_is_never_learned(tmp_path: Path) -> None:
    tok = {"kind": "hf", "path": "tok/tokenizer.json", "eos": "<|endoftext|>"}
    plan = chat_plan(tmp_path, [{"messages": CONVERSATIONS[0]}], tokenizer=tok)
    _, tokens, masks = overlord_piece(plan, CONVERSATIONS)
    eos = tokenizers.Tokenizer.from_file(str(tmp_path / "tok/tokenizer.json")).token_to_id(
        "<|endoftext|>"
    )
    for conversation, got_tokens, got_mask in zip(CONVERSATIONS, tokens, masks):
        ids, mask = hf_reference(tmp_path / "tok", conversation)
        assert (got_tokens, got_mask) == (ids + [eos], mask + [0])


def test_the_template_file_of_the_plan_wins_over_the_config(tmp_path: Path) -> None:
    tok = {"kind": "hf", "path": "tok/tokenizer.json", "chat_template": str(PLAIN)}
    plan = chat_plan(tmp_path, [{"messages": CONVERSATIONS[0]}], tokenizer=tok)
    write_tokenizer(tmp_path / "tok", MARKED)
    _, _, masks = overlord_piece(plan, CONVERSATIONS[:1])
    assert masks[0] == search_reference(tmp_path / "tok", CONVERSATIONS[0])[1]
    assert masks[0] != hf_reference(tmp_path / "tok", CONVERSATIONS[0])[1]


def test_assistant_mask_is_by_character_overlap() -> None:
    starts, ends = np.array([0, 3, 5, 5, 9, -1]), np.array([3, 5, 5, 9, 12, -1])
    # spans [4, 5) and [9, 10): the token [3, 5) overlaps the first, the zero-width token at 5
    # does not, [9, 12) overlaps the second; the appended end of document never
    assert assistant_mask(starts, ends, [(4, 5), (9, 10)]).tolist() == [0, 1, 0, 0, 1, 0]
    assert assistant_mask(starts, ends, []).tolist() == [0] * 6


# ---- through a Loader: packing, CP, hf_inputs ----------------------------------------------


def records(n: int) -> list[dict[str, Any]]:
    return [{"messages": CONVERSATIONS[i % len(CONVERSATIONS)]} for i in range(n)]


def batches(plan: Path, steps: int) -> list[Any]:
    with Loader(plan) as loader:
        clients = [loader.client(r) for r in range(loader.plan.world.dp)]
        return [next(c) for _ in range(steps) for c in clients]


def expected_labels(tokens: list[int], mask: list[int]) -> list[int]:
    """A document's labels: the next token where it is an assistant token, else -100."""
    nxt = [t if m else IGNORE_INDEX for t, m in zip(tokens[1:], mask[1:])]
    return nxt + [IGNORE_INDEX]


def check_batch(batch: Any, folder: Path, conversations: dict[str, Any]) -> int:
    """Every document of a batch against transformers' rendering; the labels kept."""
    seq = batch.input_ids.shape[1]
    ids, labels = batch.input_ids.reshape(-1), batch.labels.reshape(-1)
    used: dict[int, int] = {}
    kept = 0
    for s in batch.samples:
        at = s.row * seq + used.get(s.row, 0)
        used[s.row] = used.get(s.row, 0) + s.tokens
        tokens, mask = hf_reference(folder, conversations[s.id])
        assert ids[at : at + s.tokens].tolist() == tokens
        assert labels[at : at + s.tokens].tolist() == expected_labels(tokens, mask)
        kept += sum(mask[1:])
    return kept


def test_packed_rows_carry_each_documents_mask(tmp_path: Path) -> None:
    plan = chat_plan(tmp_path, records(40), world={"dp": 2})
    by_id = {f"data/chat/a.jsonl:{i}": r["messages"] for i, r in enumerate(records(40))}
    got = batches(plan, 3)
    rows_with_two = 0
    for batch in got:
        check_batch(batch, tmp_path / "tok", by_id)
        rows = [s.row for s in batch.samples]
        rows_with_two += len(rows) - len(set(rows))
        # padding and documents' ends are -100; more than that is masked
        real = batch.segment_ids > 0
        assert (batch.labels[real] == IGNORE_INDEX).sum() > len(batch.samples)
    assert rows_with_two > 0  # several documents share a row: the mask does not leak across


def test_loss_on_all_keeps_every_label_of_the_conversation(tmp_path: Path) -> None:
    plan = chat_plan(tmp_path, records(20), source={"loss_on": "all"})
    for batch in batches(plan, 2):
        a = pack(batch.input_ids[batch.segment_ids > 0], [s.tokens for s in batch.samples],
                 np.arange(len(batch.samples)), len(batch.samples), 256, 0)  # fmt: skip
        seq = batch.input_ids.shape[1]
        used: dict[int, int] = {}
        for k, s in enumerate(batch.samples):
            at = used.get(s.row, 0)
            used[s.row] = at + s.tokens
            row = batch.labels[s.row, at : at + s.tokens]
            assert row.tolist() == a["labels"][k, : s.tokens].tolist()
            assert (row[:-1] != IGNORE_INDEX).all()
        assert seq == 256


def test_cp_slices_keep_the_mask(tmp_path: Path) -> None:
    plan = chat_plan(tmp_path, records(30))
    by_id = {f"data/chat/a.jsonl:{i}": r["messages"] for i, r in enumerate(records(30))}
    batch = batches(plan, 1)[0]
    kept = check_batch(batch, tmp_path / "tok", by_id)
    for layout in (CPLayout.ZIGZAG, CPLayout.PER_DOCUMENT):
        slices = cp_slices(batch, 2, layout, 0)
        flat = batch.labels.reshape(-1)
        total = 0
        for s in slices:
            g = s.global_positions.reshape(-1)
            real = g >= 0
            assert (s.labels.reshape(-1)[real] == flat[g[real]]).all()
            assert (s.labels.reshape(-1)[~real] == IGNORE_INDEX).all()
            total += int((s.labels != IGNORE_INDEX).sum())
        assert total == kept == int((flat != IGNORE_INDEX).sum())


def test_cp_ranks_of_a_mesh_receive_the_masked_labels(tmp_path: Path) -> None:
    plan = chat_plan(tmp_path, records(30), world={"dp": 1, "cp": 2})
    by_id = {f"data/chat/a.jsonl:{i}": r["messages"] for i, r in enumerate(records(30))}
    with Loader(plan) as loader:
        parts = [loader.rank_client(r) for r in range(2)]
        slices = [next(p) for p in parts]
    # the DP batch put back together from its CP slices, each token at its global position
    rows = max(s.row for s in slices[0].samples) + 1
    ids = np.zeros(rows * 256, np.int32)
    labels = np.full(rows * 256, IGNORE_INDEX, np.int32)
    for s in slices:
        g = s.global_positions.reshape(-1)
        real = g >= 0
        ids[g[real]] = s.input_ids.reshape(-1)[real]
        labels[g[real]] = s.labels.reshape(-1)[real]
    whole = SimpleNamespace(
        input_ids=ids.reshape(rows, 256),
        labels=labels.reshape(rows, 256),
        samples=slices[0].samples,
    )
    kept = check_batch(whole, tmp_path / "tok", by_id)
    assert kept == sum(int((s.labels != IGNORE_INDEX).sum()) for s in slices) > 0


def test_hf_inputs_labels_are_the_assistant_tokens_themselves(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from overlord.torch import hf_inputs

    plan = chat_plan(tmp_path, records(12))
    by_id = {f"data/chat/a.jsonl:{i}": r["messages"] for i, r in enumerate(records(12))}
    batch = batches(plan, 1)[0]
    hf = hf_inputs(batch)
    seq = batch.input_ids.shape[1]
    used: dict[int, int] = {}
    for s in batch.samples:
        at = used.get(s.row, 0)
        used[s.row] = at + s.tokens
        tokens, mask = hf_reference(tmp_path / "tok", by_id[s.id])
        got = hf["labels"][s.row, at : at + s.tokens]
        # the model's own shift: its label at t is token t where t is an assistant token
        # (a document's first token has no context in the row: never labelled)
        want = [t if m and k else IGNORE_INDEX for k, (t, m) in enumerate(zip(tokens, mask))]
        assert got.tolist() == want
    assert hf["labels"].dtype == torch.int64 and seq == 256


@pytest.mark.parametrize(
    "name, as_text",
    [("a.parquet", False), ("a.parquet", True), ("a.jsonl.gz", False), ("a.jsonl.zst", False)],
    ids=["parquet-structs", "parquet-json-text", "gz", "zst"],
)
def test_parquet_and_compressed_sources(tmp_path: Path, name: str, as_text: bool) -> None:
    rows = [{"messages": json.dumps(r["messages"])} for r in records(16)] if as_text else None
    plan = chat_plan(tmp_path, rows or records(16), file=name)
    by_id = {f"data/chat/{name}:{i}": r["messages"] for i, r in enumerate(records(16))}
    for batch in batches(plan, 2):
        check_batch(batch, tmp_path / "tok", by_id)


def test_a_text_source_sends_no_mask_and_packs_as_before(tmp_path: Path, monkeypatch) -> None:
    import overlord.roles.constructor as constructor

    masks: list[Any] = []
    real_pack = constructor.pack

    def spy(*args: Any) -> dict[str, np.ndarray]:
        masks.append(args[6] if len(args) > 6 else None)
        return real_pack(*args)

    monkeypatch.setattr(constructor, "pack", spy)
    text = make_corpus(tmp_path / "text", {"web": 30}, batch={"tokens_per_step": 512,
                                                               "max_seq_len": 64})  # fmt: skip
    batches(text, 2)
    assert masks and all(m is None for m in masks)
    masks.clear()
    batches(chat_plan(tmp_path / "chat", records(12)), 1)
    assert masks and all(m is not None for m in masks)


# ---- bad records, the plan, validate ---------------------------------------------------------

BAD = [
    {"messages": "hello"},
    {"messages": [{"role": "user"}]},
    {"messages": [{"role": "user", "content": "hello"}]},  # no assistant turn
    {"text": "no messages"},
    {"messages": [["user", "hello"]]},
]


def test_bad_records_are_skipped_and_counted_or_named(tmp_path: Path) -> None:
    plan = chat_plan(tmp_path / "skip", [*BAD, *records(10)], on_error="skip")
    with Loader(plan) as loader:
        batch = next(loader.client(0))
        (stats,) = loader.stats()["loaders"]
    assert stats["skipped"] == len(BAD)
    assert all(int(s.id.split(":")[1]) >= len(BAD) for s in batch.samples)
    plan = chat_plan(tmp_path / "fail", [*records(3), BAD[1]])
    with pytest.raises(SourceError) as e, Loader(plan) as loader:
        next(loader.client(0))
    assert "a.jsonl" in str(e.value) and e.value.row == 3
    assert "message 0: 'content' is missing" in str(e.value)


def test_parse_messages_names_what_is_wrong() -> None:
    from overlord.sources.chat import parse_messages

    for bad, why in [
        ('"x"', "is str, expected a list"),
        ("[]", "an empty list"),
        ('[{"role": "user", "content": 3}]', "message 0: 'content' is int"),
        ('[{"role": "user", "content": "x"}]', "no assistant turn"),
        ("[1]", "message 0 is int"),
    ]:
        with pytest.raises(ChatRecordError, match=why):
            parse_messages(bad, "messages", True)
    assert parse_messages('[{"role": "user", "content": "x"}]', "messages", False)


def test_validate_renders_the_first_record(tmp_path: Path) -> None:
    plan = chat_plan(tmp_path / "good", records(2))
    assert check_sources(load_plan(plan)) == []
    for k, record in enumerate(BAD[1:4]):
        plan = chat_plan(tmp_path / f"bad{k}", [record, *records(2)])
        found = [str(p) for p in check_sources(load_plan(plan))]
        assert len(found) == 1 and "data/chat/a.jsonl, row 0" in found[0], found
    assert "no assistant turn" in found[0] or "no field" in found[0]
    plan = chat_plan(tmp_path / "none", records(2), template=None)
    found = [str(p) for p in check_sources(load_plan(plan))]
    assert len(found) == 1 and "tokenizer_config.json has none" in found[0]


def test_a_template_cannot_run_code(tmp_path: Path) -> None:
    evil = tmp_path / "evil.jinja"
    evil.write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    tok = {"kind": "hf", "path": "tok/tokenizer.json", "chat_template": str(evil)}
    plan = load_plan(chat_plan(tmp_path, records(2), tokenizer=tok))
    found = [str(p) for p in check_sources(plan)]
    assert len(found) == 1 and "refused it" in found[0]


def test_templates_get_what_transformers_gives_them_and_nothing_more() -> None:
    from overlord.sources.chat import ChatTemplate

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    used = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
        "{{ ns.n }} {{ dict(a=1) | tojson }} {{ tools is none }} {{ strftime_now is defined }}"
        "{% generation %}{{ messages[-1].content }}{{ eos_token }}{% endgeneration %}"
    )
    got = ChatTemplate(used, "t", {"eos_token": "</s>"}).render(messages)
    assert got.text == '2 {"a": 1} True Falseok</s>'
    assert got.spans == [(len(got.text) - 6, len(got.text))]
    for evil in (
        "{% set ns = namespace(__class__=1) %}",
        "{{ messages.__class__.__mro__ }}",
        "{{ messages.append(1) }}",  # the immutable sandbox: no change to the data
        "{{ raise_exception('no') }}",
    ):
        with pytest.raises(ChatRecordError, match="refused it"):
            ChatTemplate(evil, "t").render(messages)


def test_the_plan_names_what_a_chat_source_cannot_have() -> None:
    data = {
        "sources": [{"name": "c", "path": "x/*", "format": "chat", "transform": "m:f"}],
        "transforms": {"allow_imports": True},
        "batch": {"tokens_per_step": 64, "max_seq_len": 32},
    }
    with pytest.raises(PlanError) as e:
        validate_plan(data)
    fields = [f for f, _ in e.value.problems]
    assert fields == ["sources[0].transform", "tokenizer.chat_template"]
    data["sources"][0].pop("transform")
    data["tokenizer"] = {"chat_template": "t.jinja"}
    assert validate_plan(data).sources[0].loss_on.value == "assistant"


def test_the_bytes_tokenizer_with_a_template_file(tmp_path: Path) -> None:
    tok = {"kind": "bytes", "chat_template": str(MARKED)}
    plan = load_plan(chat_plan(tmp_path, records(4), tokenizer=tok))
    texts = pa.array([json.dumps(CONVERSATIONS[0])], pa.large_string())
    piece = encode_chat(plan_template(plan), make_tokenizer(plan.tokenizer), plan.sources[0], texts)
    assert piece.mask is not None
    text = bytes(piece.tokens[piece.mask == 1].tolist()).decode()
    assert text == "\nhello to you<|im_end|>\n"  # the generation block's output, byte for byte


def test_pipeline_stages_get_the_masked_labels_on_the_last(tmp_path: Path) -> None:
    plan = chat_plan(tmp_path, records(20), world={"dp": 1, "pp": 2})
    by_id = {f"data/chat/a.jsonl:{i}": r["messages"] for i, r in enumerate(records(20))}
    with Loader(plan) as loader:
        clients = [loader.rank_client(r) for r in range(2)]  # both before either takes a step
        first, last = (next(c) for c in clients)
    assert (first.step, last.step) == (0, 0)
    assert first.labels is None and last.input_ids is None
    whole = SimpleNamespace(input_ids=first.input_ids, labels=last.labels, samples=last.samples)
    assert check_batch(whole, tmp_path / "tok", by_id) > 0


@pytest.mark.ray
@pytest.mark.integration
def test_the_mask_travels_through_rays_object_store(ray_session: Any, tmp_path: Path) -> None:
    plan = chat_plan(tmp_path, records(30), world={"dp": 2})
    with Loader(load_plan(plan), runtime="ray") as loader:
        clients = [loader.client(r) for r in range(2)]
        on_ray = [next(c) for c in clients]
    for got, want in zip(on_ray, batches(plan, 1)):
        assert [s.id for s in got.samples] == [s.id for s in want.samples]
        assert (got.labels == want.labels).all() and (got.input_ids == want.input_ids).all()
        assert (got.labels == IGNORE_INDEX).sum() > (want.segment_ids == 0).sum()


@pytest.mark.parametrize("policy", ["split", "truncate"])
def test_long_conversations_cut_their_mask_with_their_tokens(tmp_path: Path, policy: str) -> None:
    plan = chat_plan(
        tmp_path,
        records(12),
        batch={"max_seq_len": 48, "tokens_per_step": 480, "long_docs": policy},
    )
    by_id = {f"data/chat/a.jsonl:{i}": r["messages"] for i, r in enumerate(records(12))}
    chunks = 0
    for batch in batches(plan, 3):
        ids, labels = batch.input_ids.reshape(-1), batch.labels.reshape(-1)
        used: dict[int, int] = {}
        for s in batch.samples:
            at = s.row * 48 + used.get(s.row, 0)
            used[s.row] = used.get(s.row, 0) + s.tokens
            base, _, k = s.id.partition("#")
            first = 48 * int(k) if k else 0
            chunks += bool(k)
            tokens, mask = hf_reference(tmp_path / "tok", by_id[base])
            tokens, mask = tokens[first : first + s.tokens], mask[first : first + s.tokens]
            assert ids[at : at + s.tokens].tolist() == tokens
            assert labels[at : at + s.tokens].tolist() == expected_labels(tokens, mask)
    assert (chunks > 0) == (policy == "split")


def test_a_resumed_chat_job_continues_with_the_same_masked_labels(tmp_path: Path) -> None:
    plan = chat_plan(tmp_path, records(30), world={"dp": 1})
    with Loader(plan) as loader:
        client = loader.client(0)
        whole = [next(client) for _ in range(4)]
    with Loader(plan) as loader:
        client = loader.client(0)
        for _ in range(2):
            next(client)
        state = json.loads(json.dumps(loader.state_dict()))  # as a checkpoint holds it
    with Loader(plan, state=state) as loader:
        client = loader.client(0)
        resumed = [next(client) for _ in range(2)]
    for got, want in zip(resumed, whole[2:]):
        assert (got.step, [s.id for s in got.samples]) == (want.step, [s.id for s in want.samples])
        assert (got.labels == want.labels).all() and (got.input_ids == want.input_ids).all()
