"""The `deadpool train` job: a megatron-core GPT on mock data, its worker processes and its
local launcher; the embedded twin of the Megatron-LM integration, over the same driver."""
