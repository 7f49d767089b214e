"""SamplingParams.validate(): the constructor's checks, run again on demand."""

from __future__ import annotations

import pytest

from m3eagle.sampling.params import SamplingParams, SamplingParamsError


@pytest.mark.parametrize("field, value", [("temperature", float("nan")), ("n", 0), ("seed", 2**70),
                                          ("top_k", -5), ("logprobs", 21), ("min_tokens", 10**6)])
def test_validate_names_the_changed_field(field, value):
    sp = SamplingParams()
    sp.validate()  # a valid object stays valid (and unchanged)
    setattr(sp, field, value)
    with pytest.raises(SamplingParamsError, match=field):
        sp.validate()


def test_validate_is_idempotent():
    sp = SamplingParams(top_k=-1, stop="x", seed=3)
    before = repr(sp)
    sp.validate()
    assert repr(sp) == before and sp.top_k == 0 and sp.stop == ["x"]
