"""What every JUnit XML the resilience test writes must be: one testsuite of testcases, failures counted."""

from __future__ import annotations

import xml.etree.ElementTree as ET


def validate_junit(text: str) -> dict[str, list[str]]:
    """Check the JUnit XML's structure (one testsuite of testcases, failures counted right); return
    each testcase's failure messages by name."""
    suite = ET.fromstring(text.split("?>", 1)[1] if text.startswith("<?xml") else text)
    assert suite.tag == "testsuite" and suite.get("name")
    cases = list(suite)
    assert cases and all(c.tag == "testcase" and c.get("classname") and c.get("name") for c in cases)
    out = {c.get("name"): [f.get("message") for f in c.findall("failure")] for c in cases}
    assert all(all(f.get("message") and f.get("type") for f in c.findall("failure")) for c in cases)
    assert int(suite.get("tests")) == len(cases)
    assert int(suite.get("failures")) == sum(bool(m) for m in out.values())
    return out
