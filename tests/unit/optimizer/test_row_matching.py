"""match_rows: one-to-one pairing of detections within tolerance, per group, across several outputs."""

from __future__ import annotations

import numpy as np

from service.optimizer.row_matching import closest_miss, match_rows


def _parts(*arrays):
    """Each array as one part of a single group: [rows, values] -> [1, rows, values]."""
    return [np.asarray(a, np.float64).reshape(1, len(a), -1) for a in arrays]


def test_a_permutation_is_found_jointly_over_the_parts():
    rng = np.random.default_rng(0)
    boxes, labels = rng.random((50, 4)), rng.integers(0, 3, 50)
    perm = rng.permutation(50)
    assignment = match_rows(_parts(boxes, labels), _parts(boxes[perm], labels[perm]), [1e-6, 0.0])
    np.testing.assert_array_equal(perm[assignment[0]], np.arange(50))


def test_rows_that_agree_only_part_by_part_do_not_match():
    # Same boxes and same labels as sets, but the labels belong to other boxes.
    boxes, labels = np.array([[0.0], [1.0]]), np.array([1, 2])
    assignment = match_rows(_parts(boxes, labels), _parts(boxes, labels[::-1]), [1e-6, 0.0])
    assert (assignment < 0).all()


def test_a_maximum_matching_is_found_where_first_fit_pairing_fails():
    # tolerance 1: expected 0.5 is close to got 0.0 and 1.4, expected 0.0 only to got 0.0. Pairing rows in
    # order gives 0.5 the 0.0 and leaves 0.0 without a partner; a maximum matching re-routes.
    assignment = match_rows(_parts([[0.5], [0.0]]), _parts([[0.0], [1.4]]), [1.0])
    assert assignment.tolist() == [[1, 0]]


def test_a_value_beyond_the_tolerance_leaves_its_row_unmatched_and_is_reported():
    expected = np.array([[0.0, 0.0], [5.0, 5.0], [9.0, 9.0]])
    got = expected[[2, 0, 1]].copy()
    got[0, 1] += 0.5  # the row of 9.0, off by 0.5 in its second value
    parts, got_parts = _parts(expected), _parts(got)
    assignment = match_rows(parts, got_parts, [0.1])
    assert assignment.tolist() == [[1, 2, -1]]
    assert closest_miss(parts, got_parts, [0.1], assignment) == (0.5, 0)
    assert (match_rows(parts, got_parts, [0.6]) >= 0).all()


def test_integer_parts_must_be_equal():
    scores, labels = [[0.5], [0.5]], [3, 4]
    assignment = match_rows(_parts(scores, labels), _parts(scores, [3, 5]), [1e-3, 0.0])
    assert (assignment < 0).sum() == 1


def test_nan_matches_nan_and_infinities_match_the_same_infinity():
    expected = [[np.nan, 1.0], [np.inf, 2.0], [-np.inf, 3.0]]
    got = [[-np.inf, 3.0], [np.nan, 1.0], [np.inf, 2.0]]
    assert match_rows(_parts(expected), _parts(got), [1e-6]).tolist() == [[1, 2, 0]]
    wrong = [[np.nan, 1.0], [-np.inf, 2.0], [np.inf, 3.0]]  # signs of the infinities swapped
    assert (match_rows(_parts(expected), _parts(wrong), [1e-6]) < 0).sum() == 2


def test_rows_never_move_between_groups():
    # [2 images, 2 detections, 1 value]: the images' detections swapped between the images.
    expected = np.array([[[1.0], [2.0]], [[3.0], [4.0]]])
    got = np.array([[[3.0], [2.0]], [[1.0], [4.0]]])
    assignment = match_rows([expected], [got], [1e-6])
    assert assignment.tolist() == [[-1, 1], [-1, 1]]


def test_many_alike_rows_match():
    # 2000 detections with only 3 distinct rows, shuffled: every row has hundreds of candidates.
    rng = np.random.default_rng(1)
    rows = np.repeat(np.array([[0.0, 1.0], [1.0, 0.0], [0.5, 0.5]]), [700, 700, 600], axis=0)
    perm = rng.permutation(len(rows))
    assignment = match_rows(_parts(rows), _parts(rows[perm]), [1e-6])
    assert (assignment >= 0).all() and len(set(assignment[0].tolist())) == len(rows)
