"""``GlobalSamplePosition``: a global sample index, re-split over any number of ranks (elastic resume)."""

from __future__ import annotations

import pytest
import torch

from opd_store.opd import GlobalSamplePosition


def _positions(world_size: int, state: dict | None = None, *, size: int = 30, batch: int = 2):
    positions = [GlobalSamplePosition(torch.Generator().manual_seed(7), dataset_size=size, batch_size=batch,
                                      rank=rank, world_size=world_size) for rank in range(world_size)]
    if state is not None:
        for position in positions:
            position.load_state_dict(state)
    return positions


def _steps(positions, epoch: int, count: int | None = None) -> list[list[list[int]]]:
    iterators = [position.iterate(epoch) for position in positions]
    steps = []
    while count is None or len(steps) < count:
        try:
            steps.append([next(iterator) for iterator in iterators])
        except StopIteration:
            break
    return steps


@pytest.mark.parametrize(("before", "after", "done_steps"), [(4, 2, 2), (2, 4, 3), (4, 3, 1), (1, 5, 4), (3, 3, 2)])
def test_resplit_over_another_world_size_skips_and_repeats_nothing(before, after, done_steps):
    first = _positions(before)
    consumed = _steps(first, 0, done_steps)
    state = first[0].state_dict()
    assert all(position.state_dict()["samples_done"] == state["samples_done"] for position in first)  # replicated
    assert state["samples_done"] == min(30, done_steps * before * 2)
    rest = _steps(_positions(after, state), 0)
    samples = [i for step in consumed + rest for batch in step for i in batch]
    assert sorted(samples) == list(range(30))
    order = torch.randperm(30, generator=torch.Generator().manual_seed(7)).tolist()
    assert [i for step in consumed + rest for batch in step for i in batch] == order  # rank-major within a step


def test_next_epoch_after_a_resume_is_the_uninterrupted_one():
    uninterrupted = _positions(2)
    _steps(uninterrupted, 0)
    expected = _steps(uninterrupted, 1)
    assert expected
    first = _positions(2)
    _steps(first, 0, 3)
    resumed = _positions(2, first[0].state_dict())
    _steps(resumed, 0)
    assert _steps(resumed, 1) == expected


def test_every_rank_takes_the_same_number_of_steps_at_an_epoch_end():
    steps = _steps(_positions(4, size=10, batch=2), 0)
    assert [[len(batch) for batch in step] for step in steps] == [[2, 2, 2, 2], [2, 0, 0, 0]]


def test_refusals():
    generator = torch.Generator()
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        GlobalSamplePosition(generator, dataset_size=4, batch_size=1, rank=2, world_size=2)
    position = GlobalSamplePosition(generator, dataset_size=4, batch_size=1, rank=0, world_size=1)
    with pytest.raises(ValueError, match="missing"):
        position.load_state_dict({"epoch": 0})
    with pytest.raises(ValueError, match="samples_done must be a non-negative int"):
        position.load_state_dict({"epoch": 0, "samples_done": -1, "epoch_start_generator_state": generator.get_state()})
    with pytest.raises(ValueError, match="before the sample position's epoch"):
        position.load_state_dict({"epoch": 2, "samples_done": 0, "epoch_start_generator_state": generator.get_state()})
        next(position.iterate(1))
