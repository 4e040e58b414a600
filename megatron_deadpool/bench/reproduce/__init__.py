"""Reproducing the paper's figures on this machine (`deadpool bench paper`): the matrix of
jobs and modes, the recovery runs, and the workers (DeadPool, checkpoint restart, NVRx) they
are compared with."""
