"""Workers: plain classes that take and return `Batch` (actor + rollout + reference, critic).

`tiller.distributed.create_worker_group` runs them in-process (backend=local) or as Ray actors.
Import the classes from their modules: `tiller.workers.actor.ActorRolloutRefWorker`,
`tiller.workers.critic.CriticWorker`.
"""
