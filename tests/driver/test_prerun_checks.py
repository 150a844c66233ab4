"""Checks a run makes before Ray starts, each failing in one line (issue 37)."""
from __future__ import annotations

import pytest

from raytune_ft.recipe.recipe import Recipe, RecipeError, apply_overrides


@pytest.mark.parametrize("setting, suggestion", [("train.lrr=1", "did you mean train.lr?"),
                                                 ("tarin.lr=1", "did you mean train.lr?")])
def test_misspelled_setting_suggests_the_nearest_name(setting, suggestion):
    with pytest.raises(RecipeError, match=suggestion.replace("?", r"\?")):
        apply_overrides(Recipe(), [setting])


def test_a_name_far_from_any_suggests_nothing():
    with pytest.raises(RecipeError) as e:
        apply_overrides(Recipe(), ["train.zzzzqqq=1"])
    assert "did you mean" not in str(e.value)
