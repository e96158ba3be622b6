"""Tensor names kept as one text (``formats.Names``): every name is still answered, in order, and repeats
are still found."""

from __future__ import annotations

import random

import pytest

from modelload.loader.formats import Names, has_repeats


def some_names(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    odd = ["", "é", '"', "\\", "\n", "名前", "\U0001f600", "a\x00b"]
    return [
        f"layers.{i}.mlp.experts.{rng.randrange(64)}.w" if rng.random() < 0.8 else rng.choice(odd) + str(i)
        for i in range(count)
    ]


@pytest.mark.parametrize("count", [0, 1, 5, 4095, 4096, 4097, 10_000])
def test_every_name_is_answered_by_index_slice_and_iteration_in_order(count: int) -> None:
    listed = some_names(count, count)
    names = Names(listed)
    assert len(names) == count
    assert list(names) == listed
    assert [names[i] for i in range(count)] == listed
    assert [names[-i] for i in range(1, count + 1)] == [listed[-i] for i in range(1, count + 1)]
    assert names[3:4100] == listed[3:4100]
    assert names[::7] == listed[::7]
    assert names[5:2] == []
    assert names == listed and names == tuple(listed) and names == Names(listed)
    assert names != [*listed, "x"]
    with pytest.raises(IndexError):
        names[count]
    with pytest.raises(IndexError):
        names[-count - 1]


def test_names_of_several_files_join_in_order() -> None:
    parts = [some_names(seed, count) for seed, count in enumerate([3, 0, 4097, 1])]
    joined = Names.concat([Names(part) for part in parts])
    assert list(joined) == [name for part in parts for name in part]
    assert joined.text == "".join(name for part in parts for name in part)


def test_a_repeated_name_is_found_and_distinct_names_are_not_taken_for_repeats() -> None:
    listed = some_names(1, 20_000)
    distinct = list(dict.fromkeys(listed))
    assert not has_repeats(distinct) and not has_repeats(Names(distinct))
    assert has_repeats([*distinct, distinct[123]]) and has_repeats(Names([distinct[-1], *distinct]))
    assert not has_repeats([]) and not has_repeats(Names())


def test_the_repeat_check_is_answered_once_per_names_and_right_either_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from modelload.loader.formats import _index

    hashed: list[int] = []
    real = _index.np.fromiter

    def counting(*args: object, **kwargs: object) -> object:
        hashed.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(_index.np, "fromiter", counting)
    unique, twice = Names(["a", "b", "c"]), Names(["a", "b", "a"])
    assert [has_repeats(unique), has_repeats(unique), has_repeats(twice), has_repeats(twice)] == [
        False, False, True, True,
    ]  # fmt: skip
    assert len(hashed) == 2
    assert has_repeats(Names.concat([unique, Names(["a"])])) is True  # a new column is checked anew


def test_joined_names_are_checked_from_the_hashes_their_parts_took_without_making_names_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    unique = [[f"file{k}.{name}" for name in dict.fromkeys(some_names(k, 3000))] for k in range(3)]
    clash = [unique[0], unique[1], [*unique[2], unique[0][7]]]
    joined = [Names.concat([Names(part) for part in listed]) for listed in (unique, clash)]

    def made_again(*args: object) -> object:
        raise AssertionError("a name was made again to be hashed")

    monkeypatch.setattr(Names, "_between", made_again)
    monkeypatch.setattr(Names, "__getitem__", made_again)
    assert has_repeats(joined[0]) is False
    with pytest.raises(AssertionError, match="made again"):
        has_repeats(joined[1])  # equal hashes: only then are the names themselves compared
