"""The time replay: a discrete-event simulation of gpuslice on a trace over time, with
Kubernetes (API rules, kube-scheduler, kubelet) and the node agents modelled as they behave,
static-layout baselines and parameter sweeps."""
