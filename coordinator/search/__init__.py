"""The search: tuners that propose trials, assessors that stop hopeless ones, NNI's and
Optuna's algorithms behind the same interfaces, and the search space."""
