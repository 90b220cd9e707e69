"""softmax, top-k (ties by lower index), records and Triton's classification strings."""

from __future__ import annotations

import numpy as np
import pytest

from service.errors import EngineError
from service.imaging import Postprocess, classification_strings, classify, softmax, top_k


def test_softmax_matches_the_formula_and_sums_to_one():
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 3, (4, 10)).astype(np.float32)
    got = softmax(logits)
    expected = np.exp(logits.astype(np.float64)) / np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=1e-6)


def test_softmax_is_stable_for_large_logits():
    got = softmax(np.array([[1000.0, 1001.0, 999.0], [-1000.0, -1001.0, -1002.0]]))
    e = np.exp([-1.0, 0.0, -2.0])
    np.testing.assert_allclose(got[0], e / e.sum())
    e = np.exp([0.0, -1.0, -2.0])
    np.testing.assert_allclose(got[1], e / e.sum())


def test_softmax_infinities_and_nan():
    got = softmax(np.array([[0.0, -np.inf, 1.0], [np.inf, 0.0, np.inf], [np.nan, 0.0, 1.0]]))
    assert got[0, 1] == 0.0 and got[0].sum() == pytest.approx(1.0)
    np.testing.assert_array_equal(got[1], [0.5, 0.0, 0.5])
    assert np.isnan(got[2]).all()


def test_softmax_of_integers_is_float64():
    assert softmax(np.array([[1, 2, 3]], dtype=np.int64)).dtype == np.float64


def test_top_k_orders_ties_by_lower_index():
    indices, values = top_k(np.array([[1.0, 3.0, 3.0, 2.0, 3.0], [5.0, 5.0, 5.0, 5.0, 5.0]]), 2)
    np.testing.assert_array_equal(indices, [[1, 2], [0, 1]])
    np.testing.assert_array_equal(values, [[3.0, 3.0], [5.0, 5.0]])


def test_top_k_agrees_with_a_full_sort_on_many_ties():
    rng = np.random.default_rng(1)
    scores = rng.integers(0, 6, (50, 40)).astype(np.float32)
    for k in (1, 3, 7, 40, 60):
        indices, values = top_k(scores, k)
        for row in range(scores.shape[0]):
            expected = sorted(range(40), key=lambda i, r=row: (-scores[r, i], i))[: min(k, 40)]
            assert indices[row].tolist() == expected
            np.testing.assert_array_equal(values[row], scores[row, expected])


def test_top_k_refuses_bad_arguments():
    with pytest.raises(ValueError):
        top_k(np.zeros((2, 0)), 1)
    with pytest.raises(ValueError):
        top_k(np.zeros((2, 3)), 0)


def test_records_carry_label_index_and_probability():
    logits = np.log(np.array([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]], dtype=np.float32))
    records = classify(logits, Postprocess(top_k=2, labels=("cat", "dog", "fox")))
    assert [[(r["label"], r["index"]) for r in row] for row in records] == [
        [("dog", 1), ("fox", 2)],
        [("cat", 0), ("fox", 2)],
    ]
    assert records[0][0]["score"] == pytest.approx(0.6, rel=1e-6)
    assert list(records[0][0]) == ["label", "index", "score"]


def test_records_without_labels_have_no_label_and_raw_scores_without_softmax():
    records = classify(np.array([[2.0, 7.5, -1.0]], dtype=np.float32), Postprocess(softmax=False, top_k=5))
    assert records == [[{"index": 1, "score": 7.5}, {"index": 0, "score": 2.0}, {"index": 2, "score": -1.0}]]


def test_scores_are_taken_over_every_non_batch_element():
    scores = np.array([[[[0.1]], [[0.9]]], [[[0.8]], [[0.2]]]], dtype=np.float32)  # [2, 2, 1, 1]
    records = classify(scores, Postprocess(softmax=False, top_k=1))
    assert [row[0]["index"] for row in records] == [1, 0]


def test_classification_strings_follow_tritons_format():
    # std::to_string: printf("%f") for floats, plain digits for integers; ":label" only with labels.
    scores = np.array([[0.1234567, 12.0, -3.5, 1e-7]], dtype=np.float32)
    assert classification_strings(scores, Postprocess(softmax=False, top_k=4)) == [
        ["12.000000:1", "0.123457:0", "0.000000:3", "-3.500000:2"]
    ]
    labelled = Postprocess(softmax=False, top_k=2, labels=("a", "b:c", "d", "e"))
    assert classification_strings(scores, labelled) == [["12.000000:1:b:c", "0.123457:0:a"]]
    ints = np.array([[3, 17, 5]], dtype=np.int32)
    assert classification_strings(ints, Postprocess(softmax=False, top_k=2)) == [["17:1", "5:2"]]


def test_classification_strings_print_the_float32_value_as_c_does():
    value = np.float32(0.1) + np.float32(1e-9)  # float32(0.1) is 0.100000001490116...
    assert classification_strings(np.array([[value, 0.0]], dtype=np.float32), Postprocess(softmax=False, top_k=1)) == [
        ["0.100000:0"]
    ]
    half = np.array([[0.0000005, 0.0000015]], dtype=np.float64)  # %f rounds the binary value
    assert classification_strings(half, Postprocess(softmax=False, top_k=2)) == [["0.000002:1", "0.000000:0"]]


def test_softmax_probabilities_in_strings():
    logits = np.log(np.array([[0.25, 0.75]], dtype=np.float32))
    assert classification_strings(logits, Postprocess(top_k=2, labels=("no", "yes"))) == [
        ["0.750000:1:yes", "0.250000:0:no"]
    ]


@pytest.mark.parametrize(
    ("scores", "words"),
    [
        (np.array([[0.1, np.nan]], dtype=np.float32), "sample 0 holds NaN"),
        (np.array([[0.0, 1.0], [np.inf, 0.0]], dtype=np.float32), "sample 1 has an infinite score"),
        (np.array([1.0, 2.0]), "needs a batch axis|classes need a batch axis"),
        (np.array([[True, False]]), "dtype bool"),
    ],
)
def test_unrankable_outputs_are_engine_errors(scores, words):
    with pytest.raises(EngineError, match=words):
        classify(scores, Postprocess(softmax=False))


def test_an_infinite_logit_under_softmax_is_a_certain_class():
    records = classify(np.array([[0.0, np.inf, 1.0]], dtype=np.float32), Postprocess(top_k=1))
    assert records == [[{"index": 1, "score": 1.0}]]
