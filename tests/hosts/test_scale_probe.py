"""The scale bench's exchange probe on namespace hosts: it measures the link it runs over
(a rows transfer cannot beat the shaped rate) and its costs feed the scaling model."""

import pytest


def test_the_exchange_probe_measures_the_link_it_crosses(hosts, drive):
    rows = 2_000_000
    free = drive("exchange_probe", str(rows))
    hosts.shape("100mbit", None)
    try:
        shaped = drive("exchange_probe", str(rows))
    finally:
        hosts.shape(None, None)
    rate = 100e6 / 8
    # a batch's rows of one owner cross the link once: at 100 Mbit/s no faster than bytes / rate
    assert shaped["transfer_s"] >= 0.9 * rows / rate, shaped
    # a mini-batch's collectives move at least the dense all-reduce's half each way
    assert shaped["round_s"] >= 0.9 * (400_000 / 2) / rate, shaped
    assert free["transfer_s"] < shaped["transfer_s"] and free["round_s"] < shaped["round_s"], (free, shaped)
    assert free["round_cpu_s"] is None  # no cores of their own: no CPU figures
    assert shaped["count"] == 3 and shaped["rows_bytes"] == pytest.approx(rows)
