variable "region" {
  description = "AWS region of the checkpoint bucket (put it near the GPUs)."
  type        = string

  validation {
    condition     = can(regex("^[a-z]{2}(-[a-z]+)+-[0-9]$", var.region))
    error_message = "region must be an AWS region name such as us-east-1."
  }
}

variable "bucket_name" {
  description = "Name of the checkpoint bucket (globally unique). The replica, if any, is named <bucket_name>-replica."
  type        = string

  validation {
    condition     = length(var.bucket_name) <= 55
    error_message = "bucket_name must be at most 55 characters, so that \"<bucket_name>-replica\" is a valid bucket name too."
  }
}

variable "run_prefix" {
  description = "Key prefix of the store in the bucket, e.g. \"llama-8b/grpo\"."
  type        = string
}

variable "versioning_enabled" {
  description = "Turn on versioning (forced on when replica_region is set). See the README for the trade-off."
  type        = bool
  default     = false
  nullable    = false
}

variable "noncurrent_version_expiration_days" {
  description = "With versioning on: days a deleted or overwritten checkpoint object stays recoverable."
  type        = number
  default     = 7
  nullable    = false
}

variable "replica_region" {
  description = "Region of a replica bucket to resume from if the main region is lost; null for none."
  type        = string
  default     = null

  validation {
    condition     = var.replica_region == null || can(regex("^[a-z]{2}(-[a-z]+)+-[0-9]$", var.replica_region))
    error_message = "replica_region must be an AWS region name such as us-west-2, or null."
  }
}

variable "training_role_names" {
  description = "Existing IAM roles of training jobs (get the read-write policy)."
  type        = list(string)
  default     = []
  nullable    = false
}

variable "eval_role_names" {
  description = "Existing IAM roles of evaluation jobs (get the read-only policy)."
  type        = list(string)
  default     = []
  nullable    = false
}

variable "failover_role_names" {
  description = "Existing IAM roles that get the read-write policy on the replica, for a job resumed in the replica region. Empty by default: a failover is a deliberate step."
  type        = list(string)
  default     = []
  nullable    = false
}

variable "tags" {
  description = "Tags for every resource."
  type        = map(string)
  default     = { "managed-by" = "terraform", "app" = "ckptstore" }
  nullable    = false
}
