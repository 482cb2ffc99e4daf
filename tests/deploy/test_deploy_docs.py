"""docs/deploy.md quotes the chart's files as they are."""

from __future__ import annotations

import re

from chart_util import CHART, ROOT, render

DOC = (ROOT / "docs" / "deploy.md").read_text()


def test_the_2p2d_example_in_the_docs_is_the_example_file():
    blocks = re.findall(r"```yaml\n(.*?)```", DOC, re.S)
    example = (CHART / "examples" / "h200-2p2d.yaml").read_text()
    assert example in blocks


def test_named_value_files_exist_and_render():
    for name in set(re.findall(r"`(ci/[a-z0-9-]+\.yaml)`", DOC)):
        assert (CHART / name).is_file(), name
    assert render()  # the default values render


def test_h200_defaults_table_matches_values_yaml():
    import yaml

    values = yaml.safe_load((CHART / "values.yaml").read_text())
    engine, prefill, decode = values["engine"]["args"], values["prefill"]["args"], values["decode"]["args"]
    rows = {m.group(2): m.group(1) for m in re.finditer(r"^\| (\S+) \| `--([a-z-]+)`", DOC, re.M)}
    assert rows["tp-size"] == str(engine["tp-size"]) and rows["page-size"] == str(engine["page-size"])
    assert rows["kv-cache-dtype"] == f"`{engine['kv-cache-dtype']}`"
    assert rows["mem-fraction-static"] == str(engine["mem-fraction-static"])
    assert rows["chunked-prefill-size"] == str(prefill["chunked-prefill-size"])
    assert rows["cuda-graph-max-bs"] == str(decode["cuda-graph-max-bs"])
    assert prefill["disable-cuda-graph"] is True and rows["disable-cuda-graph"] == "on"
