"""The mcguard command and its tools: the PD stress, the demo, the
benchmarks (bench, peerbench) and the GPU check (devicecheck)."""
