import pytest

from anyfit.config import ConfigError, TrainConfig
from anyfit.data.batching import IGNORE_INDEX, BatchPlan, WindowSampler, collate


def test_plan_derives_accumulation():
    p = BatchPlan.from_config(TrainConfig(effective_batch=32, micro_batch=4), processes=2)
    assert (p.micro_batch, p.accumulation, p.processes) == (4, 4, 2)
    assert p.micro_batch * p.accumulation * p.processes == 32


def test_plan_caps_micro_at_per_process_share():
    p = BatchPlan.from_config(TrainConfig(effective_batch=8, micro_batch=8), processes=4)
    assert (p.micro_batch, p.accumulation) == (2, 1)


@pytest.mark.parametrize("eff,micro,procs,needle", [(30, 4, 1, "micro_batch=3"), (9, 1, 2, "multiple of 2")])
def test_inconsistent_batch_settings_are_explained(eff, micro, procs, needle):
    with pytest.raises(ConfigError, match=needle):
        BatchPlan.from_config(TrainConfig(effective_batch=eff, micro_batch=micro), processes=procs)


def test_windows_are_the_same_examples_for_any_split():
    lengths = list(range(10, 50))
    trainable = [n // 2 for n in lengths]
    one = WindowSampler(lengths, trainable, BatchPlan(8, 8, 1, 1), 0, seed=3)
    for step in range(12):  # crosses epoch boundaries (5 steps per epoch)
        ref, tokens = one.window(step)
        for plan in (BatchPlan(8, 1, 8, 1), BatchPlan(8, 2, 2, 2), BatchPlan(8, 4, 1, 2)):
            got = []
            for rank in range(plan.processes):
                mbs, t = WindowSampler(lengths, trainable, plan, rank, seed=3).window(step)
                assert t == tokens and len(mbs) == plan.accumulation
                assert all(len(mb) == plan.micro_batch for mb in mbs)
                got += [i for mb in mbs for i in mb]
            assert sorted(got) == sorted(ref[0])
    # each epoch visits every full window's examples once, and epochs are shuffled differently
    e0 = [i for s in range(5) for i in one.window(s)[0][0]]
    e1 = [i for s in range(5, 10) for i in one.window(s)[0][0]]
    assert len(set(e0)) == 40 and e0 != e1


def test_collate_pads_right_and_shifts_targets():
    b = collate([{"input_ids": [1, 2, 3], "labels": [IGNORE_INDEX, 2, 3]}, {"input_ids": [4, 5], "labels": [IGNORE_INDEX, 5]}],
                pad_id=0)
    assert b["input_ids"].tolist() == [[1, 2, 3], [4, 5, 0]]
    assert b["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    # position t is trained on the label of t + 1; the last real token and padding predict nothing
    assert b["keep"].tolist() == [[True, True, False], [True, False, False]]
    assert b["keep_targets"].tolist() == [2, 3, 5]


def test_collate_packed_has_no_padding_and_restarts_positions():
    b = collate([{"input_ids": [1, 2, 3], "labels": [IGNORE_INDEX, 2, 3]}, {"input_ids": [4, 5], "labels": [IGNORE_INDEX, 5]}],
                pad_id=0, packed=True)
    assert b["input_ids"].tolist() == [[1, 2, 3, 4, 5]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert "attention_mask" not in b  # transformers derives the block-causal mask from position_ids
    # token 3 (last of example 1) must not be trained to predict token 4 (first of example 2)
    assert b["keep"].tolist() == [0, 1, 3]
    assert b["keep_targets"].tolist() == [2, 3, 5]
