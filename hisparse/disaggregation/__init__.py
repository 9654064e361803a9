"""Prefill-decode disaggregation: a prefill instance computes a prompt's rows and writes them straight into the
decode instance's pools with Mooncake's transfer engine; only room numbers and row addresses cross the control
channel (the prefill side's bootstrap server)."""
