"""`python -m hisparse.bench_serving --pd`: its flags refused before any server starts, its table from its rows (the
deployments themselves are what tests/server/test_pd_disaggregation.py covers)."""

from __future__ import annotations

from hisparse.bench import pd_serving
from hisparse.bench_serving import main as bench_serving


def test_a_request_longer_than_the_context_is_refused_before_any_server(capsys):
    assert bench_serving(["--pd", "--requests", "1", "--prompt-tokens", "8190", "--output-tokens", "8"]) == 2
    assert "exceeds the model's context" in capsys.readouterr().err


def test_the_table_shows_each_deployments_figures():
    rows = [{"deployment": "co-located, baseline", "output_tok_s": 10.0, "ttft_median_s": 2.0, "itl_median_s": 0.1,
             "decode_node_tok_s": 20.0, "errors": []},
            {"deployment": "PD, hisparse decode", "output_tok_s": 30.0, "ttft_median_s": 1.0, "itl_median_s": 0.05,
             "decode_node_tok_s": 40.0, "kv_gb_s": 0.4, "kv_wait_mean_s": 0.7, "errors": ["HTTP 502"]}]
    text = pd_serving.markdown({"workload": "toy", "results": rows})
    assert "| co-located, baseline | 10.0 | 2.00 | 100 | 20.0 | - | - | 0 |" in text
    assert "| PD, hisparse decode | 30.0 | 1.00 | 50 | 40.0 | 0.40 | 0.70 | 1 |" in text
