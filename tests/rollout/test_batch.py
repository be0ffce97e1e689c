"""RolloutBatch: row layout (repeat/select/split/concat), metadata alignment, stack_rows, save/load."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flowrl.rollout import RolloutBatch, stack_rows


def _prompts(num: int) -> RolloutBatch:
    rows = [
        {"raw_prompt": f"prompt {i}", "ground_truth": f"gt {i}", "data_source": f"src{i % 2}", "topic": i * 10}
        for i in range(num)
    ]
    batch = RolloutBatch.from_rows(rows, meta_info={"step": 3})
    # A tensor that records each row's prompt index, so tensor/metadata alignment is checkable.
    return batch.add_tensors({"prompt_index": torch.arange(num), "image": torch.rand(num, 3, 4, 4)})


def _assert_aligned(batch: RolloutBatch) -> None:
    """Every row's tensor and metadata still belong to the same prompt."""
    for row in range(len(batch)):
        index = int(batch.batch["prompt_index"][row])
        assert batch.non_tensor_batch["raw_prompt"][row] == f"prompt {index}"
        assert batch.non_tensor_batch["ground_truth"][row] == f"gt {index}"
        assert batch.non_tensor_batch["topic"][row] == index * 10


def _assert_equal(a: RolloutBatch, b: RolloutBatch) -> None:
    assert set(a.batch) == set(b.batch) and set(a.non_tensor_batch) == set(b.non_tensor_batch)
    for name in a.batch:
        assert a.batch[name].dtype == b.batch[name].dtype and torch.equal(a.batch[name], b.batch[name]), name
    for name in a.non_tensor_batch:
        assert list(a.non_tensor_batch[name]) == list(b.non_tensor_batch[name]), name


def test_from_rows_fills_standard_fields():
    batch = RolloutBatch.from_rows([{"raw_prompt": "a cat"}, {"raw_prompt": "a dog", "seed": 7, "extra": 1}])
    assert len(batch) == 2
    nt = batch.non_tensor_batch
    assert list(nt["agent_name"]) == ["diffusion", "diffusion"]
    assert list(nt["data_source"]) == ["default", "default"]
    assert list(nt["negative_prompt"]) == [None, None] and list(nt["ground_truth"]) == [None, None]
    assert list(nt["seed"]) == [None, 7] and list(nt["extra"]) == [None, 1]
    assert len(set(nt["uid"])) == 2 and all(isinstance(uid, str) for uid in nt["uid"])
    assert all(array.dtype == object and array.shape == (2,) for array in nt.values())


def test_from_rows_keeps_list_values_as_single_objects():
    batch = RolloutBatch.from_rows(
        [{"raw_prompt": "a", "ground_truth": ["x", "y"]}, {"raw_prompt": "b", "ground_truth": ["z", "w"]}]
    )
    assert batch.non_tensor_batch["ground_truth"].shape == (2,)
    assert batch.non_tensor_batch["ground_truth"][1] == ["z", "w"]


def test_from_rows_requires_raw_prompt():
    with pytest.raises(ValueError, match="raw_prompt.*rename 'prompt'"):
        RolloutBatch.from_rows([{"prompt": "a cat"}])


@pytest.mark.parametrize("num_prompts, n", [(1, 1), (3, 4), (5, 2)])
def test_repeat_interleaved_groups_share_uid(num_prompts, n):
    base = _prompts(num_prompts)
    repeated = base.repeat(n)
    assert len(repeated) == num_prompts * n
    _assert_aligned(repeated)
    order = repeated.batch["prompt_index"].tolist()
    assert order == [i for i in range(num_prompts) for _ in range(n)]
    uids = repeated.non_tensor_batch["uid"]
    for group in range(num_prompts):
        members = uids[group * n : (group + 1) * n]
        assert set(members) == {base.non_tensor_batch["uid"][group]}
    assert len(set(uids)) == num_prompts
    assert repeated.meta_info == base.meta_info


def test_repeat_tiled_order():
    repeated = _prompts(3).repeat(2, interleave=False)
    assert repeated.batch["prompt_index"].tolist() == [0, 1, 2, 0, 1, 2]
    _assert_aligned(repeated)


def test_split_then_concat_round_trips():
    batch = _prompts(7).repeat(2)
    parts = batch.split(3)
    assert [len(part) for part in parts] == [3, 3, 3, 3, 2]
    for part in parts:
        _assert_aligned(part)
    _assert_equal(RolloutBatch.concat(parts), batch)


@pytest.mark.parametrize(
    "indices", [[4, 0, 2], slice(1, 5, 2), np.array([True, False, True, False, True]), torch.tensor([3, 3, 1]), [-1, 0]]
)
def test_select_matches_numpy_indexing(indices):
    batch = _prompts(5)
    picked = batch.select(indices)
    expected = np.arange(5)[indices.numpy() if isinstance(indices, torch.Tensor) else indices]
    assert picked.batch["prompt_index"].tolist() == expected.tolist()
    _assert_aligned(picked)
    _assert_equal(batch[indices], picked)


def test_getitem_by_name_and_int():
    batch = _prompts(3)
    assert batch["raw_prompt"][2] == "prompt 2"
    assert torch.equal(batch["prompt_index"], torch.arange(3))
    assert len(batch[1]) == 1 and batch[1]["raw_prompt"][0] == "prompt 1"
    with pytest.raises(KeyError, match="nope"):
        batch["nope"]
    with pytest.raises(IndexError):
        batch.select([3])


def test_length_mismatches_name_the_field():
    batch = _prompts(3)
    with pytest.raises(ValueError, match="'all_log_probs' has 2 rows"):
        batch.add_tensors({"all_log_probs": torch.zeros(2, 4)})
    with pytest.raises(ValueError, match="'seed' has 4 rows"):
        batch.add_non_tensors({"seed": [1, 2, 3, 4]})
    with pytest.raises(ValueError, match="'images'"):
        RolloutBatch({"images": torch.zeros(2, 3)}, {"raw_prompt": ["a", "b", "c"]})


def test_add_non_tensors_replaces_a_column():
    batch = _prompts(3).add_non_tensors({"seed": [11, 12, 13]})
    assert list(batch.non_tensor_batch["seed"]) == [11, 12, 13]


def test_union_merges_and_rejects_conflicts():
    batch = _prompts(2)
    scored = RolloutBatch({"rewards": torch.tensor([0.5, 0.1])}, {"raw_prompt": batch.non_tensor_batch["raw_prompt"]})
    merged = batch.union(scored)
    assert torch.equal(merged.batch["rewards"], torch.tensor([0.5, 0.1])) and "image" in merged.batch
    with pytest.raises(ValueError, match="raw_prompt"):
        batch.union(RolloutBatch(non_tensor_batch={"raw_prompt": ["x", "y"]}))


def _sample(length: int, with_negative: bool, rng: torch.Generator) -> dict:
    return {
        "images": torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=rng),
        "all_log_probs": torch.randn(3, generator=rng),
        "prompt_embeds": torch.randn(length, 5, generator=rng) + 1.0,  # never exactly zero
        "prompt_embeds_mask": torch.ones(length, dtype=torch.bool),
        "pooled_prompt_embeds": None,
        "negative_prompt_embeds": torch.randn(length, 5, generator=rng) if with_negative else None,
        "negative_prompt_embeds_mask": torch.ones(length, dtype=torch.bool) if with_negative else None,
    }


def test_stack_rows_pads_variable_length_fields():
    rng = torch.Generator().manual_seed(0)
    lengths = [3, 7, 1, 5]
    rows = [_sample(length, False, rng) for length in lengths]
    stacked = stack_rows(rows)
    assert "pooled_prompt_embeds" not in stacked and "negative_prompt_embeds" not in stacked
    assert stacked["images"].shape == (4, 3, 8, 8) and stacked["images"].dtype == torch.uint8
    assert stacked["prompt_embeds"].shape == (4, max(lengths), 5)
    assert stacked["prompt_embeds_mask"].dtype == torch.bool
    assert stacked["prompt_embeds_mask"].sum(1).tolist() == lengths
    for row, length in enumerate(lengths):
        assert torch.equal(stacked["prompt_embeds"][row, :length], rows[row]["prompt_embeds"])
        assert not stacked["prompt_embeds"][row, length:].any()
        assert not stacked["prompt_embeds_mask"][row, length:].any()
        assert torch.equal(stacked["all_log_probs"][row], rows[row]["all_log_probs"])


def test_stack_rows_errors_name_the_field():
    rng = torch.Generator().manual_seed(1)
    with pytest.raises(ValueError, match="negative_prompt_embeds"):
        stack_rows([_sample(2, True, rng), _sample(2, False, rng)])
    uneven = [_sample(2, False, rng), _sample(2, False, rng)]
    uneven[1]["all_log_probs"] = torch.randn(4)  # not a masked sequence field: must not be padded
    with pytest.raises(ValueError, match="all_log_probs"):
        stack_rows(uneven)
    broken = [_sample(3, False, rng)]
    broken[0]["prompt_embeds_mask"] = torch.ones(2, dtype=torch.bool)
    with pytest.raises(ValueError, match="prompt_embeds_mask"):
        stack_rows(broken)


def test_concat_repads_batches_of_different_prompt_lengths():
    rng = torch.Generator().manual_seed(2)
    rows = [_sample(length, True, rng) for length in (2, 6, 4)]
    first = RolloutBatch(stack_rows(rows[:1]), {"raw_prompt": ["a"]})
    second = RolloutBatch(stack_rows(rows[1:]), {"raw_prompt": ["b", "c"]})
    _assert_equal(RolloutBatch.concat([first, second]), RolloutBatch(stack_rows(rows), {"raw_prompt": ["a", "b", "c"]}))


def test_save_load_round_trip(tmp_path):
    rng = torch.Generator().manual_seed(3)
    batch = RolloutBatch.from_rows(
        [
            {"raw_prompt": "a", "ground_truth": {"text": "HI", "boxes": [1, 2]}},
            {"raw_prompt": "b", "ground_truth": None},
        ],
        meta_info={"timing": {"gen": 1.5}},
    )
    batch.add_tensors(stack_rows([_sample(2, True, rng), _sample(4, True, rng)]))
    batch.add_tensors({"half": torch.randn(2, 3).to(torch.bfloat16)})
    batch.add_non_tensors({"seed": np.array([5, 6])})
    path = tmp_path / "rollout.safetensors"
    batch.save(str(path))
    loaded = RolloutBatch.load(str(path))
    _assert_equal(loaded, batch)
    assert loaded.meta_info == batch.meta_info
    assert type(loaded.non_tensor_batch["seed"][0]) is int


def test_save_rejects_non_json_values(tmp_path):
    batch = RolloutBatch.from_rows([{"raw_prompt": "a", "blob": object()}])
    with pytest.raises(ValueError, match="blob"):
        batch.save(str(tmp_path / "x.safetensors"))


def test_load_rejects_foreign_safetensors(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "weights.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(ValueError, match="not a RolloutBatch"):
        RolloutBatch.load(str(path))
