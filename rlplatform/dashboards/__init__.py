"""What a person reads: TensorBoard (server, custom-scalars layout, HParams) and PNG reports."""
