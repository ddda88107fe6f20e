"""The worked example in ``anyfit.data.batching`` (``WindowSampler``'s and ``collate``'s docstrings) is true: its
numbers asserted here one by one, and the docstring examples themselves run, so the text cannot drift from the
code."""

import doctest

import anyfit.data.batching as batching
from anyfit.data.batching import IGNORE_INDEX, BatchPlan, WindowSampler, collate

# Five examples of 3, 5, 2, 4 and 1 tokens; example i's ids are 10 * i + 1, 10 * i + 2, ... and its first token
# is the prompt (not trained).
IDS = [[1, 2, 3], [11, 12, 13, 14, 15], [21, 22], [31, 32, 33, 34], [41]]
EXAMPLES = [{"input_ids": ids, "labels": [IGNORE_INDEX, *ids[1:]]} for ids in IDS]
LENGTHS, TRAINED = [3, 5, 2, 4, 1], [2, 4, 1, 3, 0]


def windows(plan: BatchPlan, step: int):
    """Each of the 2 processes' (micro-batches, window trained tokens) at ``step``, seed 0."""
    return [WindowSampler.of(EXAMPLES, plan, p, seed=0).window(step) for p in (0, 1)]


def test_the_examples_are_the_ones_described():
    assert [len(ids) for ids in IDS] == LENGTHS
    assert [sum(t != IGNORE_INDEX for t in e["labels"]) for e in EXAMPLES] == TRAINED


def test_which_examples_land_in_which_window_process_and_micro_batch():
    plan = BatchPlan(effective_batch=4, micro_batch=2, accumulation=1, processes=2)
    sampler = WindowSampler.of(EXAMPLES, plan, 0, seed=0)
    assert sampler.steps_per_epoch == 1  # 5 // 4: the fifth example of each epoch's order sits it out
    assert sampler._permutation(0).tolist() == [4, 0, 1, 3, 2]
    assert sampler._permutation(1).tolist() == [0, 4, 2, 3, 1]
    # step 0: window [4, 0, 1, 3]; process 0 gets [4, 0], process 1 [1, 3], each sorted longest first
    assert windows(plan, 0) == [([[0, 4]], 9), ([[1, 3]], 9)]  # 9 = 2 + 0 + 4 + 3 trained tokens
    # step 1 (epoch 1): window [0, 4, 2, 3]; process 1's [2, 3] sorted to [3, 2]
    assert windows(plan, 1) == [([[0, 4]], 6), ([[3, 2]], 6)]  # 6 = 2 + 0 + 1 + 3
    # micro-batch 1, accumulation 2: the same examples per process, as two micro-batches
    assert windows(BatchPlan(4, 1, 2, 2), 0) == [([[0], [4]], 9), ([[1], [3]], 9)]


def test_collate_of_process_1s_micro_batch_padded():
    padded = collate([EXAMPLES[1], EXAMPLES[3]], pad_id=0)
    assert set(padded) == {"input_ids", "attention_mask", "keep", "keep_targets"}
    assert padded["input_ids"].tolist() == [[11, 12, 13, 14, 15], [31, 32, 33, 34, 0]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    assert padded["keep"].tolist() == [[True, True, True, True, False], [True, True, True, False, False]]
    assert padded["keep_targets"].tolist() == [12, 13, 14, 15, 32, 33, 34]


def test_collate_of_process_1s_micro_batch_packed():
    packed = collate([EXAMPLES[1], EXAMPLES[3]], pad_id=0, packed=True)
    assert set(packed) == {"input_ids", "position_ids", "packed_lengths", "cu_seq_lens", "keep", "keep_targets"}
    assert packed["input_ids"].tolist() == [[11, 12, 13, 14, 15, 31, 32, 33, 34]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert packed["packed_lengths"] == (5, 4)
    assert packed["cu_seq_lens"].tolist() == [0, 5, 9]
    assert packed["keep"].tolist() == [0, 1, 2, 3, 5, 6, 7]  # not 4: token 15 does not learn to predict 31
    assert packed["keep_targets"].tolist() == [12, 13, 14, 15, 32, 33, 34]


def test_the_docstring_examples_run():
    tests = {t.name.rsplit(".", 1)[-1]: t for t in doctest.DocTestFinder().find(batching) if t.examples}
    assert {"WindowSampler", "collate"} <= set(tests), "the worked example left the docstrings"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests.values():
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0, "the docstring's numbers are not what the code gives (above)"
