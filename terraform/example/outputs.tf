output "uri" {
  description = "Store URI for the training config."
  value       = module.checkpoints.uri
}

output "storage_options" {
  description = "Storage options for the training config."
  value       = module.checkpoints.storage_options
}

output "training_config" {
  description = "uri and storage_options as one JSON document."
  value       = module.checkpoints.training_config
}

output "cli_example" {
  description = "List the store's steps from a machine with the training or read-only role."
  value       = module.checkpoints.cli_example
}

output "training_policy_arn" {
  description = "Read-write policy (attach to training roles not listed in training_role_names)."
  value       = module.checkpoints.training_policy_arn
}

output "read_only_policy_arn" {
  description = "Read-only policy for evaluation jobs."
  value       = module.checkpoints.read_only_policy_arn
}

output "replica_uri" {
  description = "Store URI in the replica region (resume there after a regional outage), or null."
  value       = var.replica_region == null ? null : module.replica[0].uri
}

output "replica_storage_options" {
  description = "Storage options for the replica, or null."
  value       = var.replica_region == null ? null : module.replica[0].storage_options
}
