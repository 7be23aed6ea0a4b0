# A checkpoint bucket for one training run (or a family of runs under one prefix), with an
# optional replica in another region.

module "replica" {
  source = "../modules/ckptstore-bucket"
  count  = var.replica_region == null ? 0 : 1

  providers = {
    aws = aws.replica
  }

  bucket_name                        = "${var.bucket_name}-replica"
  run_prefix                         = var.run_prefix
  versioning_enabled                 = true # a replication destination must be versioned
  noncurrent_version_expiration_days = var.noncurrent_version_expiration_days
  training_role_names                = var.failover_role_names
  read_only_role_names               = var.eval_role_names
}

module "checkpoints" {
  source = "../modules/ckptstore-bucket"

  bucket_name                        = var.bucket_name
  run_prefix                         = var.run_prefix
  versioning_enabled                 = var.versioning_enabled || var.replica_region != null
  noncurrent_version_expiration_days = var.noncurrent_version_expiration_days
  training_role_names                = var.training_role_names
  read_only_role_names               = var.eval_role_names

  replication = var.replica_region == null ? null : {
    destination_bucket_arn  = module.replica[0].bucket_arn
    destination_kms_key_arn = module.replica[0].kms_key_arn
  }
}
