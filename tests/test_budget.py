"""``overlord.plan.budget``: a source reads ahead in proportion to its peak share."""

from __future__ import annotations

from overlord.plan.budget import peak_share, token_budget
from overlord.plan.spec import validate_plan


def plan(schedule: list[dict] | None) -> object:
    data: dict = {
        "sources": [{"name": n, "path": n, "format": "jsonl"} for n in ("web", "code", "math")],
        "batch": {"tokens_per_step": 8192, "max_seq_len": 1024, "lookahead": 4},
    }
    if schedule is not None:
        data["mixture"] = {"schedule": schedule}
    return validate_plan(data)


def test_the_peak_share_over_a_curriculum_sizes_the_read_ahead() -> None:
    p = plan(
        [
            {"step": 0, "weights": {"web": 6, "code": 2, "math": 0}},
            {"step": 100, "weights": {"web": 2, "code": 2, "math": 4}},
        ]
    )
    assert peak_share(p, "web") == 0.75 and peak_share(p, "math") == 0.5
    assert peak_share(p, "code") == 0.25
    whole = token_budget(p)
    assert token_budget(p, 1, "web") == int(whole * 0.75) + 1
    assert token_budget(p, 2, "code") == -(-(int(whole * 0.25) + 1) // 2)  # shared by 2 loaders


def test_equal_shares_without_a_mixture_and_a_floor_of_two_rows() -> None:
    p = plan(None)
    assert peak_share(p, "math") == 1 / 3
    assert token_budget(p, 1, "math") == int(token_budget(p) / 3) + 1
    tiny = plan([{"step": 0, "weights": {"web": 1000, "code": 1, "math": 1}}])
    assert token_budget(tiny, 1, "code") == 2 * 1024  # two rows, however small its share
