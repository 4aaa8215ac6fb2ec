"""What runs the policy: in-process sampling (`sampling`), packed forwards (`packing`), the vLLM servers' pool
(`server_pool`) and their weight sync (`weight_sync`). The vLLM client itself is the trainer's VLLMServerClient."""
