"""``image_tokens.carry_labels``: the text pipeline's loss mask carried onto the processor's expanded ids."""

from anyfit.data.image_tokens import carry_labels

X = -100


def test_a_placeholder_expanded_in_place_keeps_every_label():
    # user: <vision_start> <image_pad> <vision_end> q | assistant: a b <end>
    text_ids = [1, 50, 51, 52, 7, 2, 8, 9, 3]
    labels = [X, X, X, X, X, X, 8, 9, 3]
    ids = [1, 50, 51, 51, 51, 51, 52, 7, 2, 8, 9, 3]
    carried = carry_labels(text_ids, labels, ids)
    assert carried.labels == [X, X, X, X, X, X, X, X, X, 8, 9, 3]
    assert carried.image_tokens == 3 and carried.last_image_token == 5


def test_text_merged_with_the_expansion_is_never_trained():
    # Gemma-3: "\n\n" written around the image merges with the newline before it (a token that is not the text's own)
    text_ids = [1, 10, 60, 7, 2, 8, 3]
    labels = [X, X, X, X, X, 8, 3]
    ids = [1, 11, 60, 61, 61, 62, 12, 7, 2, 8, 3]
    carried = carry_labels(text_ids, labels, ids)
    assert carried.labels == [X] * 9 + [8, 3]
    assert carried.last_image_token == 6


def test_an_expansion_that_changes_a_trained_token_is_refused():
    text_ids = [1, 60, 8, 9, 3]
    labels = [X, X, 8, 9, 3]
    ids = [1, 61, 61, 13, 9, 3]  # the trained 8 merged into the image's closing text
    assert carry_labels(text_ids, labels, ids) is None


def test_the_eos_appended_after_the_text_is_carried_over():
    text_ids = [1, 60, 7, 8, 4, 0]  # 0: the EOS the text pipeline appends after the rendered text
    labels = [X, X, X, 8, 4, 0]
    ids = [1, 61, 61, 7, 8, 4]
    carried = carry_labels(text_ids, labels, ids)
    assert carried.labels == [X, X, X, X, 8, 4, 0]
    assert carried.image_tokens == 2


def test_a_bos_the_processor_adds_is_context():
    text_ids = [60, 7, 8]
    labels = [X, X, 8]
    ids = [5, 61, 61, 7, 8]
    assert carry_labels(text_ids, labels, ids).labels == [X, X, X, X, 8]
