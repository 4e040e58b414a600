"""The control plane at scale without a cluster: the coordinator alone over thousands of
simulated ranks (`deadpool bench control-plane`), simulated ranks over the store's wire
protocol, and the store's size over a long job."""
