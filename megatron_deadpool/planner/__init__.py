"""The capacity planner (`deadpool plan`): memory, traffic, recovery time and failure coverage
of a layout, from the job schema alone. Pure: no torch, no Megatron, no communication."""
