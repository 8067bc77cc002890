"""TensorBoard and W&B logging of each step."""
