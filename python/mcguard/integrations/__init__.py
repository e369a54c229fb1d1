"""mcguard in other software: Mooncake's TransferEngine API over a guard
(mooncake), the vLLM and SGLang plugins and their wiring into each
framework's request lifecycle, and Prometheus metrics."""
