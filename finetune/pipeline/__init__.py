"""The pipeline and command line (top layer): `cli` (python -m finetune), `stages` (mode=... in order),
`smoke` (smoke=true), `compare` (mode=compare) and `plan_report` (the plan's printout)."""
