output "uri" {
  description = "The store URI to put in a training config: s3://<bucket>/<run_prefix>."
  value       = "s3://${aws_s3_bucket.this.id}/${var.run_prefix}"
}

output "storage_options" {
  description = "ckptstore storage options for this bucket (CheckpointStore(uri, storage_options=...), or `-o KEY=VALUE` on the command line). Credentials come from the job's IAM role, never from here."
  value = {
    region = local.region
  }
}

output "training_config" {
  description = "The two settings a training job needs, as JSON (paste into a config, or read with `terraform output -raw training_config`)."
  value = jsonencode({
    uri             = "s3://${aws_s3_bucket.this.id}/${var.run_prefix}"
    storage_options = { region = local.region }
  })
}

output "cli_example" {
  description = "A command that lists the store's steps with these settings."
  value       = "ckptstore ls s3://${aws_s3_bucket.this.id}/${var.run_prefix} -o region=${local.region}"
}

output "bucket_name" {
  description = "Name of the checkpoint bucket."
  value       = aws_s3_bucket.this.id
}

output "bucket_arn" {
  description = "ARN of the checkpoint bucket (the replication destination of another instance)."
  value       = aws_s3_bucket.this.arn
}

output "region" {
  description = "Region of the bucket."
  value       = local.region
}

output "kms_key_arn" {
  description = "ARN of the bucket's KMS key (the replica key of another instance)."
  value       = aws_kms_key.this.arn
}

output "kms_key_alias" {
  description = "Alias of the bucket's KMS key."
  value       = aws_kms_alias.this.name
}

output "training_policy_arn" {
  description = "IAM policy for training jobs: list, read, write and delete under the run prefix, multipart cleanup, the KMS key through S3."
  value       = aws_iam_policy.training.arn
}

output "read_only_policy_arn" {
  description = "IAM policy for evaluation jobs: list and read under the run prefix, decrypt through S3."
  value       = aws_iam_policy.read_only.arn
}

output "replication_role_arn" {
  description = "IAM role S3 replication assumes, or null without replication."
  value       = local.replicate ? aws_iam_role.replication[0].arn : null
}
