"""`--train-backend megatron`: megatron-core's GPTModel behind the torch backend's interface.

Owns the model built from a Hugging Face config and its weight mapping (`model`), the backend
that swaps the actor's forward (`backend`), pipeline and context parallelism (`pipeline`,
`context`), megatron's distributed optimizer (`optimizer`), torch_dist checkpoints (`dist`),
and the explicit CPU compatibility patches (`cpu`, applied when the backend starts, never at
import). Imported only when that backend is asked for: megatron-core is an optional extra.
"""
