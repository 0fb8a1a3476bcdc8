"""TRL's `trl.experimental` trainers tiller runs: `tiller.trl.experimental.cpo` (CPOConfig / CPOTrainer: CPO and
SimPO) and `tiller.trl.experimental.orpo` (ORPOConfig / ORPOTrainer), each on `tiller dpo`'s reference-free losses.
`from trl.experimental.cpo import CPOTrainer` becomes `from tiller.trl.experimental.cpo import CPOTrainer` (or
`from tiller.trl import CPOTrainer`)."""
