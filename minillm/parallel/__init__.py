"""Tensor parallelism (lesson 20): one model split across processes that compute each step together.

`group` starts and names the process group (torch.distributed: gloo on a CPU, NCCL on
GPUs); `shard` turns a loaded model into one rank's shard (Megatron's split: heads and
the MLP's hidden units divided among ranks, one all-reduce after attention and one after
the MLP, the vocabulary split for the embedding and the LM head).
"""
