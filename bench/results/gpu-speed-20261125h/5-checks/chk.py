import sys; sys.path.insert(0, "bench")
import rollout_bench
print(rollout_bench.check_attention_kernel())
print(rollout_bench.check_sampler_kernel())
