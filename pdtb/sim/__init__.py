"""`pdtb sim`: a discrete-event simulation that drives the real scheduler, page pools, fairness
policies, prefill order, decode-side admission and hand-off logic, with the model's forward
pass and the KV transport replaced by cost models."""
